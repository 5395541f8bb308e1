"""How long a trainer call of each phase may run before its ranks count as hung.

A multiple (``ft.phase_timeout_factor``) of the slowest earlier call of that phase, never below
``ft.min_phase_timeout_s``; the first call of a phase (warm-up, compilation) gets ``ft.first_call_timeout_s``. A
slow call is waited for; a rank that stalls (SIGSTOP, a wedged device, a deadlock outside any collective) is not.
Shared by the cells (a hung cell is failed and replaced) and the classic world (a hung rank ends the world).
"""

from __future__ import annotations

from typing import Dict


class PhaseDeadlines:
    def __init__(self, ft) -> None:
        self.ft = ft
        self.slowest: Dict[str, float] = {}  # phase -> the slowest successful call so far (its deadline's base)

    def __call__(self, phase: str) -> float:
        if phase not in self.slowest:
            return self.ft.first_call_timeout_s
        return max(self.ft.min_phase_timeout_s, self.ft.phase_timeout_factor * self.slowest[phase])

    def record(self, phase: str, seconds: float) -> None:
        """A call of ``phase`` finished in ``seconds``."""
        self.slowest[phase] = max(self.slowest.get(phase, 0.0), seconds)

    def reset(self) -> None:
        """Every phase's next call warms up again (restored or new ranks)."""
        self.slowest.clear()
