"""What the loop does when a step loses its trainers: restore the last state in-process, or save and stop.

``StateLostError``: every cell holding a role's trained state died; the last checkpoint holds it, so every role
starts afresh from there, the step logs of the steps to redo are rewound (as ``resume`` does), and the run goes on
in the same job. ``BelowMinCellsError``: fewer than ``ft.min_cells`` cells are left and no replacement can come;
the survivors' state is saved (inside the step if they were inside it: ``rlfw.checkpoint.partial``) and the job
ends, to be restarted with ``resume=auto``.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from rlfw.checkpoint.partial import PartialStep, read_partial
from rlfw.checkpoint.resume import rewind_step_logs
from rlfw.ft.errors import BelowMinCellsError
from rlfw.ft.goodput import GoodputMeter
from rlfw.loop.metrics import log_events
from rlfw.loop.roles import Role


def restore_last_state(roles: List[Role], loggers, meter: GoodputMeter, run_dir: Path, checkpointer, step: int,
                       error: Exception) -> Tuple[int, Optional[PartialStep]]:
    """Every role restarts from the newest checkpoint (or the job's own start), as a restarted job would; the event
    ``state_restored`` says so. Returns (the step to go on from, the interrupted step that checkpoint holds, if it
    was taken inside one)."""
    point = checkpointer.last_state()
    to_step = point.step if point is not None else 0
    drained = [(role, role.group.drain_events()) for role in roles]
    loggers.reopen_files()
    rewound = rewind_step_logs(run_dir, to_step)
    meter.rewind(to_step)
    for role, events in drained:  # the failures that led here, logged after the rewind: they stay in the record
        log_events(loggers, meter, step, events, role)
    for role in roles:
        role.group.restore(str(point.path) if point is not None else None)
    loggers.event("state_restored", step, restored_step=to_step, reason=str(error)[:300],
                  checkpoint=str(point.path) if point is not None else None, rewound=rewound)
    return to_step, read_partial(point.path) if point is not None else None


def save_below_min(roles: List[Role], loggers, meter: GoodputMeter, checkpointer, step: int,
                   current: Optional[PartialStep], error: BelowMinCellsError) -> BelowMinCellsError:
    """Log the failures that led here and save what the survivors hold; returns the error to raise, naming the
    save (the error itself when there is no checkpointer)."""
    for role in roles:
        log_events(loggers, meter, step, role.group.drain_events(), role)
    if checkpointer is None:
        return error
    steps_done = step
    if current is not None and current.complete:  # the step is committed: a save after it
        current, steps_done = None, step + 1
    if current is not None:  # the survivors may be inside the step: the save says how far they got
        current.done = {role.name: role.group.minibatches_committed(step) for role in roles}
        if not any(current.done.values()):
            current = None  # nothing of the step committed: a save between steps
    path = checkpointer.save_now(steps_done, partial=current)
    held = f" and {current.done} minibatches of step {step}" if current is not None else ""
    return BelowMinCellsError(f"{error}; the trained state of {steps_done} steps{held} is saved in {path}")
