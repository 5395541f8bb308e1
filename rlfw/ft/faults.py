"""Real fault injection: the process dies (SIGKILL) at a named phase of the protocol.

Nothing is raised and nothing is cleaned up: the other cells see exactly what they would see if the machine under
this rank vanished. A scheduled kill fires once per run, whichever process reaches it first: the first to reach it
creates a marker file in the run directory (an atomic O_EXCL create) and then dies.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import List

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
ANY = -1  # cell or incarnation wildcard


def scheduled_kills(fault) -> List[dict]:
    """The kills of a ``kill_once`` schedule, in marker order (kill i fired iff ``<run_dir>/faults/kill_i`` exists)."""
    if fault.kind != "kill_once":
        return []
    kills = [dict(cell=fault.cell, step=fault.step, phase=fault.phase, incarnation=0)]
    return kills + [dict({"incarnation": 0}, **k) for k in fault.extra_kills]


def unfired_kills(fault, run_dir: str) -> List[dict]:
    """The scheduled kills that never fired in this run: a fault test that killed nothing tested nothing, so the
    run reports them as an error instead of a success."""
    markers = Path(run_dir) / "faults"
    return [kill for index, kill in enumerate(scheduled_kills(fault)) if not (markers / f"kill_{index}").exists()]


class FaultInjector:
    def __init__(self, fault, run_dir: str, cell: int, rank: int, incarnation: int, role: str = "actor"):
        self.fault, self.cell, self.rank, self.incarnation = fault, cell, rank, incarnation
        self.targeted = fault.role == role  # kills hit the policy's workers (actor) or the critic's (critic)
        self.marker_dir = Path(run_dir) / "faults"
        self.kills = scheduled_kills(fault)
        for kill in self.kills:
            if kill["phase"] not in PHASES:
                raise ValueError(f"fault phase {kill['phase']!r} is not one of {PHASES}")
        if fault.kind == "random" and fault.phase not in PHASES + ("any",):
            raise ValueError(f"fault.phase={fault.phase!r} is not one of {PHASES + ('any',)}")

    def maybe_die(self, phase: str, step: int) -> None:
        if self.fault.kind == "none" or self.rank != 0 or not self.targeted:
            return
        if self.fault.kind == "random":
            draw = random.Random(f"{self.fault.seed}/{self.cell}/{self.incarnation}/{step}/{phase}").random()
            if self.fault.phase in ("any", phase) and draw < self.fault.probability:
                self._die()
            return
        for index, kill in enumerate(self.kills):
            if (
                kill["phase"] == phase
                and step >= kill["step"]
                and kill["cell"] in (ANY, self.cell)
                and kill["incarnation"] in (ANY, self.incarnation)
                and self._claim(index)
            ):
                self._die()

    def _claim(self, index: int) -> bool:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / f"kill_{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        record = {"cell": self.cell, "incarnation": self.incarnation, "pid": os.getpid(), "time": time.time()}
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.close(fd)
        return True

    @staticmethod
    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
