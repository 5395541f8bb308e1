"""The writer: the one cell that exports the weights and writes the checkpoint for the group, with failover.

Every cell holding the trained state holds the same weights, so one of them (the first alive) writes. If it
fails (dies, stalls, or does not answer within ``ft.writer_timeout_s``), the next such cell writes instead. A save
goes into a directory of the writer's own incarnation, moved into place once it answered: a writer that was
failed over but still runs (a stall outlived, a partition) never touches its successor's files.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import ray

from rlfw.train_group.cell import Cell
from rlfw.train_group.world import get_all

# (phase, {cell id: its call}, deadline_s) -> {cell id: leader's result} of the cells that finished
FanOut = Callable[[str, Dict[int, Callable[[Cell], List[ray.ObjectRef]]], float], Dict[int, Any]]


class Writer:
    """``holders()``: the alive cells holding the trained state (at least one, or it raises); ``fan_out`` runs a
    call under the failure rules; ``event(kind, **fields)`` records the group's events."""

    def __init__(self, holders: Callable[[], List[Cell]], fan_out: FanOut, event: Callable[..., None],
                 timeout_s: float):
        self.holders, self.fan_out, self.event, self.timeout_s = holders, fan_out, event, timeout_s

    def _on_writer(self, phase: str, call: Callable[[Any, Cell], ray.ObjectRef]) -> Tuple[List[Any], Cell]:
        """Run ``call(worker, writer)`` on every rank of the writer, failing over to the next holder until one
        answers; an error of the job (the disk) stops the run at once (the failure rules). Returns the refs and
        the writer that answered."""
        while True:
            writer = self.holders()[0]
            refs = [call(w, writer) for w in writer.world.workers]
            done = self.fan_out(phase, {writer.id: lambda _: refs}, self.timeout_s)
            if writer.id in done:
                return refs, writer
            self.event("writer_failover", cell=writer.id, phase=phase)

    def export_weights(self) -> ray.ObjectRef:
        """Full weights from the writer, for the rollout engines: a reference to its leader's copy. The driver waits
        for each rank's small success return alone (``TrainerWorker.export_weights``)."""
        weights: Dict[int, ray.ObjectRef] = {}  # id(worker handle) -> its weights, per attempt

        def export(worker, _) -> ray.ObjectRef:
            weights[id(worker)], done = worker.export_weights.remote()
            return done

        _, writer = self._on_writer("weight_sync", export)
        return weights[id(writer.world.workers[0])]

    def save(self, path: str, step: int) -> None:
        """The writer writes into ``.<name>.writer-<cell>-<incarnation>`` beside ``path``, moved there once done."""
        target = Path(path)

        def own(cell: Cell) -> Path:
            return target.parent / f".{target.name}.writer-{cell.id}-{cell.incarnation}"

        _, writer = self._on_writer("checkpoint_save", lambda w, cell: w.save.remote(str(own(cell)), step))
        shutil.rmtree(target, ignore_errors=True)  # a save of this step that an earlier job never finished
        os.replace(own(writer), target)
        for stray in target.parent.glob(f".{target.name}.writer-*"):  # failed-over writers' leftovers
            shutil.rmtree(stray, ignore_errors=True)

    def minibatches_committed(self, step: int) -> int:
        """How many of RL step ``step``'s minibatches the holders committed (their cursor): what a save in the
        middle of the step holds."""
        writer = self.holders()[0]
        cursor = get_all([writer.world.workers[0].committed.remote()], timeout_s=self.timeout_s)[0]
        return cursor["minibatch_index"] + 1 if cursor["rl_step"] == step else 0
