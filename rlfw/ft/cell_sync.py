"""CellSync: how a cell's rank agrees with rank r of every other cell on each optimizer step, through torchft.

start_quorum (the Lighthouse fixes the participants; a cell that is behind heals from a peer here) -> this cell's
share of the minibatch, from its participating rank -> forward/backward -> SUM all-reduce of Megatron's grad
buffers across cells -> agreement on the dynamic global batch size -> should_commit vote. A failed or disagreeing
step is discarded (grads zeroed, no optimizer change) and retried on a fresh quorum.
"""

from __future__ import annotations

import random
import time
from typing import Any, Dict

import numpy as np
import torch
from torch.distributed import ReduceOp

from rlfw.ft.agreement import DisagreementError, verify_agreement
from rlfw.ft.errors import StateLostError
from rlfw.ft.manager import make_manager
from rlfw.ft.protocol import SyncHost

_OPS = {"min": ReduceOp.MIN, "max": ReduceOp.MAX}


class CellSync:
    """rlfw.ft.protocol.GradSync across cells; ``worker`` is any SyncHost."""

    def __init__(self, worker: SyncHost, lighthouse_address: str):
        self.worker = worker
        cfg = worker.cfg
        self.manager = make_manager(
            cell=worker.cell, group_rank=worker.rank, group_world_size=worker.world_size, host=worker.host,
            store_port=worker.store.port, lighthouse_address=lighthouse_address,
            state_dict=self._state_dict, load_state_dict=self._load_state_dict, min_replicas=cfg.ft.min_cells,
            device=worker.trainer.device, collective_timeout_s=cfg.ft.collective_timeout_s,
            quorum_timeout_s=cfg.ft.quorum_timeout_s, shared_device=cfg.cluster.gpus_per_worker < 1,
        )
        self.heal_time = None
        self.healed = False
        self.expected = 0  # cells the driver sent this call to; a quorum short of it is retried briefly
        self.join_deadline_s = cfg.ft.join_retry_s

    def expect(self, num_cells: int) -> None:
        self.expected = num_cells

    # -------------------------------------------------------------------------------------------- protocol
    def begin_step(self):
        """Join the step's quorum. The Lighthouse forms a quorum as soon as the previous members ask, so a cell
        joining (a replacement) can miss it by milliseconds; while the quorum is smaller than the cells the
        driver dispatched, ask again for up to ft.join_retry_s, then go on with who is there."""
        step_before = self.manager.current_step()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.join_deadline_s
        self.manager.start_quorum()
        while self.manager.num_participants() < self.expected and time.monotonic() < deadline:
            time.sleep(0.1)
            self.manager.start_quorum()
        if self.manager.num_participants() < self.expected:
            self.expected = self.manager.num_participants()  # a dispatched cell is gone: wait for it only once
        if self.manager.current_step() != step_before:  # this cell was behind and received a peer's state
            self.heal_time = time.perf_counter() - t0
            self.healed = True

        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(f"cell {self.worker.cell} is not participating in quorum {self.quorum_id}")
        return rank, self.manager.num_participants()

    def require_state(self, meta) -> None:
        """A replacement must have healed before it trains on anything past the first minibatch of the run."""
        if self.manager.errored() is not None:
            return  # a failed heal: this attempt will not commit and is retried on a fresh quorum
        if self.worker.incarnation > 0 and not self.healed and self.manager.current_step() == 0 and (
            meta["step"] > 0 or meta["minibatch_index"] > 0
        ):
            # Every cell in this quorum is a fresh replacement: the trained state died with its last holder.
            raise StateLostError(
                f"cell {self.worker.cell}: no live peer holds the trained state (every cell that had it died); "
                "resume from the last checkpoint"
            )

    def restore(self, optimizer_steps: int) -> None:
        """After loading a checkpoint: torchft's step count continues from it, so a replacement (step 0) is seen
        as behind and heals from a peer instead of training from fresh weights."""
        self.manager.load_state_dict({**self.manager.state_dict(), "step": optimizer_steps})

    def reduce_and_commit(self, part):
        works = [self.manager.allreduce(g, reduce_op=ReduceOp.SUM) for g in self.worker.trainer.grad_buffers()]
        self.worker.faults.maybe_die("during_allreduce", self.worker.cursor["rl_step"])  # peers are inside it
        for work in works:
            work.wait()
        try:
            verify_agreement(part, self.manager.num_participants(), self._allreduce)
        except DisagreementError as e:
            self.manager.report_error(e)
            self.manager.should_commit()
            raise
        committed = self.manager.should_commit()
        info: Dict[str, Any] = {"quorum_id": self.quorum_id, "ft_step": self.manager.current_step()}
        if committed and self.heal_time is not None:  # the worker reports committed attempts only: keep it till one
            info["heal_time"], self.heal_time = self.heal_time, None
        if not committed:
            self.worker.trainer.zero_grad()
        return committed, info

    def _allreduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self.manager.allreduce(tensor, reduce_op=_OPS[op]).wait()
        return tensor

    @property
    def quorum_id(self) -> int:
        return int(self.manager._quorum_id)  # torchft exposes the membership epoch only privately

    # ------------------------------------------------------------------------------------------- heal state
    def _state_dict(self) -> Dict[str, Any]:
        self.worker.faults.maybe_die("heal_send", self.worker.cursor["rl_step"])
        trainer = self.worker.trainer
        return {
            "model": trainer.model.module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "cursor": dict(self.worker.cursor),
        }

    def _load_state_dict(self, state: Dict[str, Any]) -> None:
        self.worker.faults.maybe_die("heal_receive", state["cursor"]["rl_step"])
        trainer = self.worker.trainer
        trainer.model.module.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        self.worker.cursor.update(state["cursor"])

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
