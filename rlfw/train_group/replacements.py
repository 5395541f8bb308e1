"""When a failed cell gets a replacement, and when it must not.

A cell that dies is replaced (``ft.replace_failed``) at most ``ft.max_replacements`` times over the run (-1: no
limit); past that budget the run goes on with its survivors (the below-minimum rule still applies). A cell id that
fails again before its replacement committed a step (a cell that dies at start-up, a node that kills whatever lands
on it) waits ``ft.replacement_backoff_s`` doubled per failure, up to a minute, instead of being restarted in a tight
loop. The budget counts replacements that were started; a placement still waiting for room is not a failure and
costs nothing. A replacement that is due (``due``) is started by the group; until it is, it is ``waiting``.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

MAX_BACKOFF_S = 60.0


class ReplacementPolicy:
    def __init__(self, replace_failed: bool, max_replacements: int, backoff_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.replace_failed, self.max_replacements, self.backoff_s = replace_failed, max_replacements, backoff_s
        self.clock = clock
        self.started = 0  # replacements started over the run
        self._streak: Dict[int, int] = {}  # per cell id: failures since its last committed step
        self._scheduled: Dict[int, Tuple[float, int]] = {}  # cell id -> (start not before, incarnation)

    def budget_left(self) -> bool:
        return self.replace_failed and (self.max_replacements < 0 or self.started < self.max_replacements)

    def on_failure(self, cell_id: int) -> Optional[float]:
        """A cell failed: when its replacement may start (a clock time), or None when none will (replacements
        off, or the budget spent)."""
        if not self.budget_left():
            return None
        streak = self._streak.get(cell_id, 0)
        self._streak[cell_id] = streak + 1
        delay = 0.0 if streak == 0 else min(self.backoff_s * 2 ** (streak - 1), MAX_BACKOFF_S)
        return self.clock() + delay

    def on_started(self) -> None:
        """A replacement's actors were created: it counts against the budget."""
        self.started += 1

    def on_committed(self, cell_id: int) -> None:
        """The cell committed a step: a later failure of it starts a new streak (no backoff)."""
        self._streak.pop(cell_id, None)

    def schedule(self, cell_id: int, incarnation: int) -> bool:
        """Cell ``cell_id`` failed: schedule incarnation ``incarnation`` of it, unless none will come (False)."""
        not_before = self.on_failure(cell_id)
        if not_before is not None:
            self._scheduled[cell_id] = (not_before, incarnation)
        return not_before is not None

    def due(self) -> List[Tuple[int, int]]:
        """(cell id, incarnation) of the scheduled replacements whose backoff is over; they are no longer waiting."""
        now = self.clock()
        ready = [(cell_id, incarnation) for cell_id, (not_before, incarnation) in self._scheduled.items()
                 if now >= not_before]
        for cell_id, _ in ready:
            del self._scheduled[cell_id]
        return ready

    def waiting(self) -> bool:
        """Whether a scheduled replacement has not been started yet."""
        return bool(self._scheduled)

    def clear(self) -> None:
        """Forget the scheduled replacements (every cell starts afresh from a checkpoint)."""
        self._scheduled.clear()
