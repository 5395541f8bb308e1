"""Real fault injection at a named phase of the protocol: the cell's process dies (SIGKILL) or stalls (SIGSTOP).

Nothing is raised and nothing is cleaned up: the other cells see exactly what they would see if the machine under
this rank vanished (``signal=kill``) or froze (``signal=stop``: a GC pause, swapping, a stuck driver call). A
scheduled fault fires once per run directory, whichever process reaches it first: the first to reach it creates a
marker file there (an atomic O_EXCL create, recording who fired, when and at which step: ``kill_<i>`` for the
i-th scheduled fault, ``random_<cell>_<incarnation>_<step>_<phase>`` for a random draw) and then acts; a job
restarted in the same run directory (``resume=auto``) does not fire it again.

A process cannot resume itself, so a stop comes from outside the cell: rank 0 starts ``rlfw.ft.stopper``, which
SIGSTOPs every rank of the cell by pid (each rank registers its pid when it starts), waits ``duration_s`` and sends
SIGCONT. Rank 0 waits for the stopper meanwhile, so it too goes no further until the stall is over.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
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
CELL_ONLY_PHASES = ("heal_send", "heal_receive")  # a classic world never heals: these never happen there
SIGNALS = ("kill", "stop")
ANY = -1  # cell or incarnation wildcard


def scheduled_kills(fault) -> List[dict]:
    """The faults of a ``kill_once`` schedule, in marker order (fault i fired iff ``<run_dir>/faults/kill_i``
    exists); an extra entry's ``signal`` and ``duration_s`` default to the schedule's."""
    if fault.kind != "kill_once":
        return []
    first = dict(cell=fault.cell, step=fault.step, phase=fault.phase, incarnation=0, signal=fault.signal,
                 duration_s=fault.duration_s)
    defaults = {"incarnation": 0, "signal": fault.signal, "duration_s": fault.duration_s}
    return [first] + [dict(defaults, **k) for k in fault.extra_kills]


def unfired_kills(fault, run_dir: str) -> List[dict]:
    """The scheduled kills that never fired in this run: a fault test that killed nothing tested nothing, so the
    run reports them as an error instead of a success."""
    markers = Path(run_dir) / "faults"
    return [kill for index, kill in enumerate(scheduled_kills(fault)) if not (markers / f"kill_{index}").exists()]


class FaultInjector:
    def __init__(self, fault, run_dir: str, cell: int, rank: int, incarnation: int, role: str = "actor",
                 world_size: int = 1):
        self.fault, self.cell, self.rank, self.incarnation = fault, cell, rank, incarnation
        self.world_size, self.role = world_size, role
        self.targeted = fault.role == role  # faults hit the policy's workers (actor) or the critic's (critic)
        self.marker_dir = Path(run_dir) / "faults"
        self.kills = scheduled_kills(fault)
        for kill in self.kills:
            if kill["phase"] not in PHASES:
                raise ValueError(f"fault phase {kill['phase']!r} is not one of {PHASES}")
            if kill["signal"] not in SIGNALS:
                raise ValueError(f"fault signal {kill['signal']!r} is not one of {SIGNALS}")
        if fault.kind == "random" and fault.phase not in PHASES + ("any",):
            raise ValueError(f"fault.phase={fault.phase!r} is not one of {PHASES + ('any',)}")
        if fault.kind != "none" and self.targeted:
            self._register_pid()

    def _pid_dir(self) -> Path:
        return self.marker_dir / "pids" / f"{self.role}-{self.cell}-{self.incarnation}"

    def _register_pid(self) -> None:
        self._pid_dir().mkdir(parents=True, exist_ok=True)
        (self._pid_dir() / str(self.rank)).write_text(str(os.getpid()))

    def maybe_fault(self, phase: str, step: int) -> None:
        """Fire the fault scheduled for ``phase`` at RL step ``step``, if any (rank 0 fires for its cell)."""
        if self.fault.kind == "none" or self.rank != 0 or not self.targeted:
            return
        if self.fault.kind == "random":
            draw = random.Random(f"{self.fault.seed}/{self.cell}/{self.incarnation}/{step}/{phase}").random()
            if self.fault.phase in ("any", phase) and draw < self.fault.probability and self._claim(
                    f"random_{self.cell}_{self.incarnation}_{step}_{phase}", self.fault.signal, step, phase):
                self._act(self.fault.signal, self.fault.duration_s)
            return
        for index, kill in enumerate(self.kills):
            if (
                kill["phase"] == phase
                and step >= kill["step"]
                and kill["cell"] in (ANY, self.cell)
                and kill["incarnation"] in (ANY, self.incarnation)
                and self._claim(f"kill_{index}", kill["signal"], step, phase)
            ):
                self._act(kill["signal"], kill["duration_s"])

    def _act(self, how: str, duration_s: float) -> None:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            self._stop_cell(duration_s)

    def _cell_pids(self) -> List[int]:
        """Every rank's pid, waiting briefly for ranks still registering (they register as their process starts)."""
        deadline = time.monotonic() + 30.0
        while len(files := list(self._pid_dir().iterdir())) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fault: only {len(files)} of {self.world_size} ranks of cell {self.cell} "
                                   f"registered a pid in {self._pid_dir()}")
            time.sleep(0.05)
        return sorted(int(f.read_text()) for f in files)

    def _stop_cell(self, duration_s: float) -> None:
        pids = self._cell_pids()
        stopper = subprocess.Popen(
            [sys.executable, "-m", "rlfw.ft.stopper", f"{duration_s}", *map(str, pids)],
            start_new_session=True,  # not in the cell's process group: a kill of the cell does not take it along
        )
        stopper.wait()  # this process is stopped too meanwhile; the stopper exits once it has sent SIGCONT

    def _claim(self, marker: str, how: str, step: int, phase: str) -> bool:
        """Create the fault's marker (O_EXCL): True for the one process that fires it in this run directory."""
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        record = {"cell": self.cell, "incarnation": self.incarnation, "pid": os.getpid(), "time": time.time(),
                  "signal": how, "step": step, "phase": phase}
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.close(fd)
        return True
