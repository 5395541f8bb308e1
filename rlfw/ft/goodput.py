"""Goodput, ETTR and MTTR as the run goes: the ``ft/*`` figures logged with every committed step.

The same definitions as ``bench/restart_loop.py``'s accounting, from the inside: goodput is the kept steps' samples
per wall second since the run's first start; ETTR the kept steps' share of that wall time; the MTTR of a failure the
time from its detection to the end of the next committed step, less a step's own compute (the median kept step).
A run is counted whole across restarts: a resumed job reads the kept steps back from ``metrics.jsonl`` (rewound to
its checkpoint first) and the first start from ``run_started.json``. A restart's own failure is dated by the dead
job's last logged step: the job that died could not log its death, so that MTTR is an upper bound.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from rlfw.run_files import METRICS, REWOUND, RUN_STARTED, read_jsonl

STEP_TIME, SAMPLES, WALL = "time/step", "train/num_samples", "time/wall"


def run_started(run_dir: Path, resuming: bool, now: float) -> float:
    """The wall time the run's first job started: written by a fresh run, read back by a resumed one."""
    path = Path(run_dir) / RUN_STARTED
    if resuming and path.exists():
        try:
            return float(json.loads(path.read_text())["started"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}): the run's start time is lost; "
                             f"remove the file to count the run from this job's start") from None
    partial = path.with_name(path.name + ".partial")  # whole or not at all: a resumed job reads it
    partial.write_text(json.dumps({"started": now}))
    os.replace(partial, path)
    return now


def _records(path: Path) -> List[dict]:
    return read_jsonl(path) if path.exists() else []


class GoodputMeter:
    def __init__(self, started: float, kept: Iterable[dict] = (), last_progress: Optional[float] = None):
        """``kept``: the metrics records of steps kept from earlier jobs; ``last_progress``: when an earlier job last
        logged a step (a resumed job's failure time, None for a fresh run)."""
        self.started = started
        self.steps: Dict[int, Tuple[float, float]] = {r["step"]: (r[STEP_TIME], r[SAMPLES]) for r in kept
                                                        if STEP_TIME in r and SAMPLES in r}
        self.pending_failure = last_progress  # a failure not yet followed by a committed step
        self.mttr_last_s: Optional[float] = None

    @classmethod
    def for_run(cls, run_dir: Path, started: float, resuming: bool) -> "GoodputMeter":
        """A fresh run's meter, or a resumed one's from the run's records (``metrics.jsonl`` already rewound)."""
        if not resuming:
            return cls(started)
        kept = _records(Path(run_dir) / METRICS)
        walls = [r[WALL] for r in kept + _records(Path(run_dir) / (METRICS + REWOUND)) if WALL in r]
        return cls(started, kept, max(walls) if walls else None)

    def failure(self, detected_at: float) -> None:
        """A failure noticed at wall time ``detected_at``; the MTTR runs from the first one since the last step."""
        if self.pending_failure is None:
            self.pending_failure = detected_at

    def rewind(self, to_step: int) -> None:
        """The steps from ``to_step`` on are thrown away (the state was restored from an older checkpoint)."""
        self.steps = {s: v for s, v in self.steps.items() if s < to_step}

    def committed(self, step: int, step_s: float, samples: float, now: Optional[float] = None) -> Dict[str, float]:
        """Count step ``step`` (its time, its samples) as kept; returns the ``ft/*`` figures to log with it."""
        now = time.time() if now is None else now
        self.steps[step] = (step_s, samples)
        if self.pending_failure is not None:
            typical = statistics.median(t for t, _ in self.steps.values())
            self.mttr_last_s = max(0.0, now - self.pending_failure - typical)
            self.pending_failure = None
        wall = max(now - self.started, 1e-9)
        figures = {
            "ft/goodput": sum(n for _, n in self.steps.values()) / wall,
            "ft/ettr": sum(t for t, _ in self.steps.values()) / wall,
            WALL: now,
        }
        if self.mttr_last_s is not None:
            figures["ft/mttr_last_s"] = self.mttr_last_s
        return figures
