"""Real fault injection: the process dies (SIGKILL) at a named phase of the protocol.

Nothing is raised and nothing is cleaned up: the other cells see exactly what they would see if the machine under
this rank vanished. Only a cell's first incarnation is hit by ``kill_once``, so its replacement survives.
"""

from __future__ import annotations

import os
import random
import signal

PHASES = (
    "before_forward",
    "mid_forward_backward",
    "during_allreduce",
    "after_vote",
    "heal_send",
    "heal_receive",
    "weight_sync",
    "checkpoint_save",
)


class FaultInjector:
    def __init__(self, fault, cell: int, rank: int, incarnation: int):
        self.fault, self.cell, self.rank, self.incarnation = fault, cell, rank, incarnation
        if fault.kind != "none" and fault.phase not in PHASES + ("any",):
            raise ValueError(f"fault.phase={fault.phase!r} is not one of {PHASES + ('any',)}")

    def maybe_die(self, phase: str, step: int) -> None:
        if self._should_die(phase, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def _should_die(self, phase: str, step: int) -> bool:
        f = self.fault
        if f.kind == "none" or self.rank != 0 or (f.phase != "any" and phase != f.phase):
            return False
        if f.kind == "kill_once":
            return self.incarnation == 0 and self.cell == f.cell and step == f.step
        # random: one draw per (cell, incarnation, step, phase); reproducible from fault.seed
        draw = random.Random(f"{f.seed}/{self.cell}/{self.incarnation}/{step}/{phase}").random()
        return draw < f.probability
