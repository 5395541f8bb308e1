"""The step protocol between a trainer rank and the ranks it must agree with, and what the protocol needs of its rank.

``train_call`` drives each optimizer step as: begin_step -> the first minibatch not yet committed -> its share for
(rank, count) -> require_state(part.meta) -> forward/backward -> reduce_and_commit(part) -> optimizer step if
committed, else back to begin_step. ClassicSync (one Megatron world) and CellSync (cells joined through torchft)
implement GradSync; TrainerWorker and the protocol tests' model-free cells both run ``train_call``.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from rlfw.data.batch import RolloutBatch
    from rlfw.ft.faults import FaultInjector


class GradSync(Protocol):
    replica_id: Optional[str]  # the Lighthouse's name for this replica's group, whose heartbeat the driver watches

    def expect(self, call: Dict[str, Any]) -> None:
        """The driver's train call under way (``id``, ``replicas`` it was sent to, ``deadline_s``): begin_step waits
        for the replicas the driver counts in it."""

    def begin_step(self) -> Tuple[int, int]:
        """Join the step; returns (this replica's rank, participant count), and this rank then holds the state of
        every other participant (a rank that was behind has healed here)."""

    def require_state(self, meta: Dict[str, Any]) -> None:
        """Raises StateLostError rather than let a rank train past the run's first minibatch on untrained state."""

    def reduce_and_commit(self, part: RolloutBatch) -> Tuple[bool, Dict[str, Any]]:
        """SUMs the grad buffers over the participants and votes: on True every participant steps on the same
        gradient; on False the grads are zeroed and the step is retried from begin_step. Raises DisagreementError
        (fatal) if the participants describe the step differently."""

    def restore(self, optimizer_steps: int) -> None:
        """After a checkpoint load: the protocol's step count continues from ``optimizer_steps``."""

    def shutdown(self) -> None:
        """Releases the protocol's servers and threads; the sync is not used afterwards."""


class SyncHost(Protocol):
    """What CellSync reads of the rank that owns it: TrainerWorker in a run, a stub in tests."""

    cfg: Any  # ft.* timeouts and min_cells, cluster.gpus_per_worker
    cell: int
    rank: int  # rank inside the cell
    world_size: int  # ranks in the cell
    host: str  # interface every listener binds
    store: TCPStore  # the cell's own store; torchft's Manager keeps its keys there
    trainer: Any  # device, grad_buffers(), zero_grad(), model.module (state_dict), optimizer
    faults: FaultInjector  # maybe_fault(phase, step) at the protocol's phases
    cursor: Dict[str, int]  # the last committed rl_step and minibatch_index, optimizer_steps: sent in a heal
    incarnation: int  # 0 for the run's first cells, > 0 for replacements (and cells restored from a checkpoint)
    heals: bool  # it takes the trained state from a live peer (a replacement), not from the init or a checkpoint
    state_lock: threading.Lock  # held while the weights and the cursor change together (a commit, a heal)


def position(meta: Dict[str, Any]) -> Tuple[int, int]:
    """Where a minibatch is in the run: (RL step, minibatch index), ordered as they are trained."""
    return meta["step"], meta["minibatch_index"]


def train_call(
    sync: GradSync,
    host: SyncHost,
    minibatches: Sequence[Any],
    meta_of: Callable[[Any], Dict[str, Any]],
    take_part: Callable[[Any, int, int], Tuple[Any, Any]],
    train_part: Callable[[Any], Dict[str, Any]],
    optimizer_step: Callable[[], Any],
) -> List[Dict[str, Any]]:
    """Commit every minibatch of a train call that is not committed yet; one record per committed step.

    The cursor moves when a step commits, never when an attempt starts, so it always names the last minibatch the
    replica group agreed on. A heal in begin_step replaces it with the sender's: a replacement that joins while
    its peers are at minibatch j (it was sent the whole list) goes on from j with them, instead of training
    minibatch 0 again; an emergency save holds exactly the minibatches that are done.
    ``take_part(minibatch, rank, count)`` -> (this rank's share, every participant's sample ids);
    ``train_part(share)`` runs forward/backward and returns its loss sums.
    """
    committed = lambda: (host.cursor["rl_step"], host.cursor["minibatch_index"])  # noqa: E731
    records, attempts = [], 0
    while any(position(meta_of(mb)) > committed() for mb in minibatches):
        attempts += 1
        t0 = time.perf_counter()
        replica, num_replicas = sync.begin_step()
        t_quorum = time.perf_counter()
        todo = [mb for mb in minibatches if position(meta_of(mb)) > committed()]
        if not todo:  # the peers are past this whole call: only a cell the driver stopped counting gets here
            raise RuntimeError(f"healed to {committed()}, past every minibatch of this call")
        part, participant_ids = take_part(todo[0], replica, num_replicas)
        step = part.meta["step"]
        sync.require_state(part.meta)
        host.faults.maybe_fault("before_forward", step)
        sums = train_part(part)
        t_fb = time.perf_counter()
        ok, info = sync.reduce_and_commit(part)
        t_sync = time.perf_counter()
        if not ok:
            continue
        host.faults.maybe_fault("after_vote", step)
        with host.state_lock:  # a save from another thread sees the step whole or not at all
            grad_norm = optimizer_step()
            host.cursor.update(rl_step=step, minibatch_index=part.meta["minibatch_index"])
            host.cursor["optimizer_steps"] += 1
        records.append({
            "minibatch_index": part.meta["minibatch_index"], "sample_ids": list(part.sample_ids),
            "participant_ids": participant_ids, "num_samples": len(part),
            "num_tokens": part.num_response_tokens(), "grad_norm": grad_norm, "sums": sums,
            "replica": replica, "num_replicas": num_replicas, "attempts": attempts,
            "time/quorum": t_quorum - t0, "time/forward_backward": t_fb - t_quorum,
            "time/reduce_and_vote": t_sync - t_fb, "time/step": time.perf_counter() - t0, **info,
        })
        attempts = 0
    return records
