"""When a failed cell gets a replacement, and when it must not.

A cell that dies is replaced (``ft.replace_failed``) at most ``ft.max_replacements`` times over the run (-1: no
limit); past that budget the run goes on with its survivors (the below-minimum rule still applies). A cell id that
fails again before its replacement committed a step (a cell that dies at start-up, a node that kills whatever lands
on it) waits ``ft.replacement_backoff_s`` doubled per failure, up to a minute, instead of being restarted in a tight
loop. The budget counts replacements that were started; a placement still waiting for room is not a failure and
costs nothing.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional

MAX_BACKOFF_S = 60.0


class ReplacementPolicy:
    def __init__(self, replace_failed: bool, max_replacements: int, backoff_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.replace_failed, self.max_replacements, self.backoff_s = replace_failed, max_replacements, backoff_s
        self.clock = clock
        self.started = 0  # replacements started over the run
        self._streak: Dict[int, int] = {}  # per cell id: failures since its last committed step

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
