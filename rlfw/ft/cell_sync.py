"""CellSync: how a cell's rank agrees with rank r of every other cell on each optimizer step, through torchft.

start_quorum until the quorum holds the cells the driver counts in the call (a cell that is behind heals from a
peer here; rlfw.ft.membership says why the driver decides) -> this cell's
share of the minibatch, from its participating rank -> forward/backward -> SUM all-reduce of Megatron's grad
buffers across cells -> agreement on the dynamic global batch size -> should_commit vote. A failed or disagreeing
step is discarded (grads zeroed, no optimizer change) and retried on a fresh quorum.
"""

from __future__ import annotations

import random
import time
from typing import Any, Dict, Tuple

import numpy as np
import torch
from torch.distributed import ReduceOp

from rlfw.ft.agreement import DisagreementError, verify_agreement
from rlfw.ft.errors import FencedError, StateLostError
from rlfw.ft.manager import make_manager
from rlfw.ft.membership import MembershipView
from rlfw.ft.protocol import SyncHost
from rlfw.ft.torchft_api import manager_replica_id, quorum_epoch

_OPS = {"min": ReduceOp.MIN, "max": ReduceOp.MAX}


def heal_state_bytes(module: torch.nn.Module) -> int:
    """An upper bound on what a heal sends: per parameter element its own bytes, Adam's two fp32 moments, and an
    fp32 master copy when the parameter is not fp32 (bf16 training)."""
    return sum(p.numel() * (p.element_size() + 8 + (0 if p.dtype == torch.float32 else 4))
               for p in module.parameters())


def heal_deadline_s(state_bytes: int, ft) -> float:
    """How long a heal may take: the collective timeout plus the state's transfer at ft.heal_min_bandwidth_mb_s (a
    link slower than that is treated as broken); a multi-GB state cannot cross in a 30 s collective timeout."""
    return ft.collective_timeout_s + state_bytes / (ft.heal_min_bandwidth_mb_s * 1e6)


class CellSync:
    """rlfw.ft.protocol.GradSync across cells; ``worker`` is any SyncHost."""

    def __init__(self, worker: SyncHost, lighthouse_address: str, membership_address: Tuple[str, int]):
        self.worker = worker
        cfg = worker.cfg
        self.manager = make_manager(
            cell=worker.cell, group_rank=worker.rank, group_world_size=worker.world_size, host=worker.host,
            store_host=worker.store.host, store_port=worker.store.port, lighthouse_address=lighthouse_address,
            state_dict=self._state_dict, load_state_dict=self._load_state_dict, min_replicas=cfg.ft.min_cells,
            device=worker.trainer.device, collective_timeout_s=cfg.ft.collective_timeout_s,
            quorum_timeout_s=cfg.ft.quorum_timeout_s,
            heal_timeout_s=heal_deadline_s(heal_state_bytes(worker.trainer.model.module), cfg.ft),
            shared_device=cfg.cluster.gpus_per_worker < 1, host_transport=cfg.ft.host_transport,
        )
        self.replica_id = manager_replica_id(worker.store)  # ``cell_<id>:<uuid>``, new for every incarnation
        self.membership = MembershipView(membership_address)
        self.heal_time = None
        self.healed = False
        self.call = 0  # the driver's id of the train call under way: its membership is what begin_step waits for
        self.call_deadline_s = 0.0  # how long the driver gives the call; a cell waits for its peers at most that
        self.joins = 0  # quorum requests so far; the n-th join decision of rank 0 is key rlfw/join/<n> of the cell

    def expect(self, call: Dict[str, Any]) -> None:
        self.call, self.call_deadline_s = call["id"], call.get("deadline_s", 0.0)

    # -------------------------------------------------------------------------------------------- protocol
    def begin_step(self):
        """Join the step's quorum: ask until it holds exactly the cells the driver still counts in this call.

        The Lighthouse issues a quorum as soon as the cells that asked could form one, so a peer that is slow
        (still in its forward pass, paused, a replacement finishing set-up) would be left out, and the survivors
        would train without it -- or it without them. Instead the quorum is asked for again until the driver's
        count matches; only the driver takes a cell out. One decision per cell: rank 0 decides each round and
        the other ranks read its decision from the cell's store, so TP ranks never disagree on whether to retry.
        """
        self._refuse_if_fenced("begin_step")
        step_before = self.manager.current_step()
        t0 = time.perf_counter()
        # A backstop only (the driver decides first): past the call's own deadline, or ft.quorum_timeout_s.
        wait_s = max(self.worker.cfg.ft.quorum_timeout_s, self.call_deadline_s)
        deadline = time.monotonic() + wait_s
        while True:
            self.manager.start_quorum()
            self._refuse_if_fenced("quorum")  # it may have slept inside start_quorum and been taken out meanwhile
            self.joins += 1
            key = f"rlfw/join/{self.joins}"
            if self.worker.rank == 0:
                expected, got = self.membership.expected(self.call), self.manager.num_participants()
                if got != expected and time.monotonic() > deadline:
                    self.worker.store.set(key, "late")
                    raise TimeoutError(
                        f"cell {self.worker.cell}: quorum of {got} cells, the driver counts {expected} in this call, "
                        f"for {wait_s:g} s (the call's deadline, at least ft.quorum_timeout_s)")
                self.worker.store.set(key, "go" if got == expected else "retry")
            decision = self.worker.store.get(key)
            if decision == b"go":
                break
            if decision == b"late":
                raise TimeoutError(f"cell {self.worker.cell}: its rank 0 gave up waiting for the quorum")
            time.sleep(0.05)
        if self.manager.current_step() != step_before:  # this cell was behind and received a peer's state
            self.heal_time = time.perf_counter() - t0
            self.healed = True

        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError(f"cell {self.worker.cell} is not participating in quorum {self.quorum_id}")
        return rank, self.manager.num_participants()

    def _refuse_if_fenced(self, where: str) -> None:
        if self.membership.fenced(self.worker.cell, self.worker.incarnation):
            if self.worker.rank == 0:
                self.membership.reject(self.worker.cell, self.worker.incarnation, where)
            raise FencedError(f"cell {self.worker.cell} (incarnation {self.worker.incarnation}) was taken out of "
                              "the run by the driver; it takes part in nothing more")

    def require_state(self, meta) -> None:
        """A replacement must have healed before it trains on anything past the first minibatch of the run."""
        if self.manager.errored() is not None:
            return  # a failed heal: this attempt will not commit and is retried on a fresh quorum
        if self.worker.heals and not self.healed and self.manager.current_step() == 0 and (
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
        # Its peers are inside the all-reduce (Gloo, NCCL), or the agreement's (shared memory returns it done).
        self.worker.faults.maybe_fault("during_allreduce", part.meta["step"])
        for work in works:
            work.wait()
        try:
            verify_agreement(part, self.manager.num_participants(), self._allreduce,
                             {"ft_step": self.manager.current_step(), "quorum_id": self.quorum_id},
                             device=self.worker.trainer.device)
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
        return quorum_epoch(self.manager)

    # ------------------------------------------------------------------------------------------- heal state
    def _state_dict(self) -> Dict[str, Any]:
        self.worker.faults.maybe_fault("heal_send", self.worker.cursor["rl_step"])
        trainer = self.worker.trainer
        return {
            "model": trainer.model.module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "cursor": dict(self.worker.cursor),
        }

    def _load_state_dict(self, state: Dict[str, Any]) -> None:
        self.worker.faults.maybe_fault("heal_receive", state["cursor"]["rl_step"])
        trainer = self.worker.trainer
        with self.worker.state_lock:
            trainer.model.module.load_state_dict(state["model"])
            trainer.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"]["torch"])
            np.random.set_state(state["rng"]["numpy"])
            random.setstate(state["rng"]["python"])
            self.worker.cursor.update(state["cursor"])

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
