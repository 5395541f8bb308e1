"""The driver's failure rules: when a cell in a call is failed, and when the call cannot go on.

A cell is failed as a unit when its call raises or its actor dies (``failure``), when its heartbeat stops for
``ft.stall_timeout_s`` (``stalled``: paused, partitioned, its host gone), or when it is still busy past the phase's
deadline (``overdue``: a multiple of that phase's measured time, so slow is not dead). An error of the job (the
disk: ``OSError``) or one no replacement can fix (``FatalError``) stops the run instead: on a survivor it would
recur. A train call left with fewer than ``ft.min_cells`` cells waits for replacements only while one can come
in time (``rescue``).

The rules are apart from how a call is made and watched: ``CellGroup`` applies them to Ray actors, the protocol
tests to plain processes, and the unit tests to a clock of their own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Mapping, Optional

from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from rlfw.ft.errors import BelowMinCellsError, FatalError, JobError

if TYPE_CHECKING:
    from rlfw.config.schema import FTConfig

HEARTBEAT_POLL_S = 0.5  # how often a call's pending cells' heartbeats are read from the Lighthouse


class FailureDetector:
    """The rules for one call of ``phase``, started when the detector is made. ``deadline_s``: how long the call
    may run; ``ft``: the run's ``ft.*`` settings (stall_timeout_s, min_cells, replacement_deadline_s,
    max_replacements)."""

    def __init__(self, phase: str, deadline_s: float, ft: FTConfig, clock: Callable[[], float] = time.monotonic):
        self.phase, self.deadline_s, self.ft = phase, deadline_s, ft
        self.stall_timeout_s = ft.stall_timeout_s
        self.clock = clock
        self.started = clock()
        self._next_heartbeat_check = self.started + HEARTBEAT_POLL_S

    def elapsed(self) -> float:
        """Seconds since the call started: how far into it a failure was noticed."""
        return self.clock() - self.started

    def failure(self, cell_id: int, error: BaseException) -> str:
        """Why the cell whose call ended in ``error`` is failed; raises instead for an error of the job."""
        if isinstance(error, RayTaskError):
            if isinstance(error.cause, FatalError):
                raise error.cause from error
            if isinstance(error.cause, OSError):
                raise JobError(f"{self.phase} failed on cell {cell_id}: {type(error.cause).__name__}: "
                               f"{error.cause}") from error
            return str(error)
        if isinstance(error, ObjectLostError):  # answered, but its node was lost (cut off) before it was fetched
            return f"its result was lost with its node: {str(error).splitlines()[0]}"
        if isinstance(error, RayActorError):
            return str(error)
        raise error

    def heartbeat_due(self) -> bool:
        """Whether the heartbeats should be read now (every ``HEARTBEAT_POLL_S``)."""
        now = self.clock()
        if now < self._next_heartbeat_check:
            return False
        self._next_heartbeat_check = now + HEARTBEAT_POLL_S
        return True

    def stalled(self, pending: Mapping[int, Optional[str]], ages: Optional[Mapping[str, float]]) -> Dict[int, str]:
        """{cell id: reason} for the pending cells (cell id -> its replica id at the Lighthouse) whose heartbeat
        is older than ``stall_timeout_s``. ``ages``: the Lighthouse's heartbeat ages by replica id, None when it
        could not be read: then nobody is declared stalled (the deadline still applies)."""
        if ages is None:
            return {}
        return {cell_id: f"no heartbeat for {ages[replica]:.1f} s, past ft.stall_timeout_s="
                         f"{self.stall_timeout_s:g} (stalled, partitioned, or its host is gone)"
                for cell_id, replica in pending.items() if replica in ages and ages[replica] > self.stall_timeout_s}

    def overdue(self, pending: Iterable[int]) -> Dict[int, str]:
        """{cell id: reason} for every pending cell once the call has run past its deadline."""
        elapsed = self.elapsed()
        if elapsed <= self.deadline_s:
            return {}
        return {cell_id: f"still busy {elapsed:.0f} s into the call, past the {self.phase} deadline of "
                         f"{self.deadline_s:.0f} s (its heartbeat goes on: slow or hung)" for cell_id in pending}

    def rescue(self, left: int, replacements_coming: bool) -> bool:
        """A train call with ``left`` cells still in it and none finished: whether the call must go to each
        replacement as soon as it is ready (fewer than ``min_cells`` left: the survivors' quorum cannot form
        without them). Raises BelowMinCellsError when none can come in time, so the loop saves the survivors'
        state instead of letting them time out in their quorum."""
        ft = self.ft
        if left >= ft.min_cells:
            return False
        if not replacements_coming or self.elapsed() > ft.replacement_deadline_s:
            raise BelowMinCellsError(
                f"only {left} cells left in the step, below ft.min_cells={ft.min_cells}, and "
                + (f"no replacement can come (ft.replace_failed is off or the ft.max_replacements="
                   f"{ft.max_replacements} are spent)" if not replacements_coming else
                   f"no replacement became ready within ft.replacement_deadline_s={ft.replacement_deadline_s}")
            )
        return True
