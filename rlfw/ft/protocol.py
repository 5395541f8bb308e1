"""The step protocol between a trainer rank and the ranks it must agree with, and what the protocol needs of its rank.

TrainerWorker drives each optimizer step as: begin_step -> its share of the minibatch for (rank, count) ->
require_state(part.meta) -> forward/backward -> reduce_and_commit(part) -> optimizer step if committed, else back
to begin_step. ClassicSync (one Megatron world) and CellSync (cells joined through torchft) implement it; the
worker depends on nothing else of either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Protocol, Tuple

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from rlfw.data.batch import RolloutBatch
    from rlfw.ft.faults import FaultInjector


class GradSync(Protocol):
    def expect(self, num_replicas: int) -> None:
        """The driver sent this train call to ``num_replicas`` replicas; begin_step may wait, bounded, for them."""

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
    faults: FaultInjector  # maybe_die(phase, step) at the protocol's phases
    cursor: Dict[str, int]  # rl_step, minibatch_index, optimizer_steps: sent with the state in a heal
    incarnation: int  # 0 for the run's first cells, > 0 for replacements
