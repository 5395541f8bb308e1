"""Run a job the way users run one today, and time it from the outside.

``supervise`` starts ``python -m rlfw.train run_dir=D resume=auto ...`` and, while the job exits with status 75 (it
lost workers it cannot go on without: a classic rank, cells below ``ft.min_cells``), starts the same command again
in the same run directory until it finishes: the checkpoint-restart loop of a cluster scheduler. The same function
runs a cells job (which should need no restart) so that both sides are timed by the same clock: the supervisor's
wall clock, and the moment each ``step N`` line reaches it on the job's console.

``account`` turns what the supervisor saw, and what the run directory holds, into the figures of one row:
goodput (committed samples per wall second), ETTR (the share of the wall clock spent in the steps that were kept),
MTTR per failure, steps recomputed and samples lost.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
EXIT_RESTARTABLE = 75  # rlfw.train's status for a job that lost workers for good (its state is on disk)
STEP_LINE = re.compile(r"^step (\d+) \(")
RESUME_LINE = re.compile(r"resuming from .* at step (\d+)( inside the step)?")


@dataclass
class Job:
    """One process of the loop, as the supervisor saw it."""

    index: int
    started: float  # wall clock (time.time())
    ended: float = 0.0
    returncode: Optional[int] = None
    steps: List[List[float]] = field(default_factory=list)  # [step, wall time its line arrived]
    resumed_at: int = 0  # the step its checkpoint let it start from
    resumed_inside: bool = False  # that checkpoint was taken inside the step and holds its batch

    @property
    def in_flight(self) -> int:
        """The step it was in when it ended (a dead job's is lost, unless the next one resumes inside it)."""
        return int(self.steps[-1][0]) + 1 if self.steps else self.resumed_at

    @property
    def first_step_s(self) -> Optional[float]:
        return self.steps[0][1] - self.started if self.steps else None


def _read_console(proc: subprocess.Popen, job: Job, log_path: Path) -> None:
    with open(log_path, "w") as log:
        for line in proc.stdout:
            log.write(line)
            if match := STEP_LINE.match(line):
                job.steps.append([int(match.group(1)), time.time()])
            elif match := RESUME_LINE.search(line):
                job.resumed_at, job.resumed_inside = int(match.group(1)), bool(match.group(2))


def supervise(run_dir: Path, overrides: Sequence[str], max_restarts: int = 20, job_timeout_s: float = 1800.0,
              fresh: bool = True) -> List[Job]:
    """Run the job until it finishes, restarting it after each restartable death; returns every job's record.
    A job that fails any other way, or runs past ``job_timeout_s``, stops the loop with an error naming its log."""
    run_dir = Path(run_dir)
    if fresh and run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rlfw.train", f"run_dir={run_dir}", "resume=auto",
           "logger.backends=[jsonl,console]", *overrides]
    jobs: List[Job] = []
    while True:
        job = Job(index=len(jobs), started=time.time())
        jobs.append(job)
        log_path = run_dir / "logs" / f"supervised_job_{job.index}.log"
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        reader = threading.Thread(target=_read_console, args=(proc, job, log_path), daemon=True)
        reader.start()
        try:
            job.returncode = proc.wait(timeout=job_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"job {job.index} ran past {job_timeout_s:.0f} s (log: {log_path})") from None
        finally:
            reader.join(timeout=30)
            job.ended = time.time()
            _write_log(run_dir, jobs)
        if job.returncode == 0:
            return jobs
        if job.returncode != EXIT_RESTARTABLE:
            raise RuntimeError(f"job {job.index} failed with status {job.returncode}, not a lost worker "
                               f"({' '.join(cmd)}); log: {log_path}\n{log_path.read_text()[-3000:]}")
        if job.index >= max_restarts:
            raise RuntimeError(f"the job died {job.index + 1} times, past max_restarts={max_restarts}")


def _write_log(run_dir: Path, jobs: List[Job]) -> None:
    """The supervisor's own record (``supervisor.json``): each job's start, end, status and step lines."""
    (run_dir / "supervisor.json").write_text(json.dumps([asdict(j) for j in jobs], indent=1))


def read_jsonl(path: Path) -> List[Dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def fault_markers(run_dir: Path) -> List[Dict]:
    """The faults that fired (``<run_dir>/faults/kill_<i>`` or ``random_*``: who, when, at which step and phase), in
    time order."""
    folder = Path(run_dir) / "faults"
    markers = [json.loads(p.read_text()) for pattern in ("kill_*", "random_*") for p in folder.glob(pattern)]
    return sorted(markers, key=lambda m: m["time"])


def account(side: str, run_dir: Path, jobs: List[Job]) -> Dict:
    """One row of the table. Outside view: the wall clock of the whole loop, and the step lines (a committed step
    each; a step seen twice was recomputed). Inside view: metrics.jsonl (the steps that were kept, their time and
    samples), its ``.rewound`` records (steps a restart threw away), events (detection, heal). MTTR of a failure:
    from the kill (its marker's time) to the next step line, less the step's own compute (the median kept step)."""
    run_dir = Path(run_dir)
    kept = read_jsonl(run_dir / "metrics.jsonl")
    rewound = [r for r in read_jsonl(run_dir / "metrics.jsonl.rewound") if "train/num_samples" in r]
    # Every event any job logged: a restart moves the records of the steps it redoes to events.jsonl.rewound.
    events = read_jsonl(run_dir / "events.jsonl") + read_jsonl(run_dir / "events.jsonl.rewound")
    markers = fault_markers(run_dir)
    fallbacks = [e for e in events if e["kind"] == "state_restored"]
    wall_s = jobs[-1].ended - jobs[0].started
    lines = sorted(t for job in jobs for _, t in job.steps)
    samples = sum(r["train/num_samples"] for r in kept)
    step_s = statistics.median(r["time/step"] for r in kept)
    mttr = []
    for marker in markers:
        after = [t for t in lines if t > marker["time"]]
        if after:
            mttr.append(max(0.0, after[0] - marker["time"] - step_s))
    # A rollout in flight when a job died is thrown away, unless the save the next job resumes from kept it (a save
    # inside the step); a job that fell back to its last checkpoint by itself threw away the step it was in.
    in_flight = [job.in_flight for job, after in zip(jobs, jobs[1:])
                 if not (after.resumed_inside and after.resumed_at == job.in_flight)]
    in_flight += [e["step"] for e in fallbacks]
    rollout_size = {r["step"]: r.get("rollout/num_samples", r["train/num_samples"]) for r in kept}
    detect = []
    for marker in markers:  # a restarted job numbers its cells' incarnations afresh: the first detection after it
        seen = [e["detected_at"] for e in events if e["kind"] == "cell_failed" and e["cell"] == marker["cell"]
                and e["incarnation"] == marker["incarnation"] and e["detected_at"] >= marker["time"]]
        if seen:
            detect.append(min(seen) - marker["time"])
    heals = [e["heal_time"] for e in events if e["kind"] == "heal"]
    # The first job's start-up (Ray, the actors, the first weight push) and the last job's shutdown are paid once by
    # every side, failure-free included; on a short run they dominate the wall clock, so ETTR is also given over
    # the training window: from the first step's start to the last step's line (every restart inside it counts).
    training_s = lines[-1] - (lines[0] - kept[0]["time/step"]) if lines else wall_s
    return {
        "side": side,
        "failures": len(markers),
        "restarts": len(jobs) - 1 + len(fallbacks),
        "steps": len(kept),
        "samples": samples,
        "wall_s": wall_s,
        "goodput": samples / wall_s,
        "ettr": sum(r["time/step"] for r in kept) / wall_s,
        "ettr_training": sum(r["time/step"] for r in kept) / training_s,
        "mttr_s": mttr,
        "mttr_median_s": statistics.median(mttr) if mttr else None,
        "mttr_max_s": max(mttr) if mttr else None,
        "detect_s": detect,
        "heal_s": heals,
        "first_step_s": [j.first_step_s for j in jobs],
        "steps_recomputed": len(lines) - len(kept),
        "samples_lost": sum(r["train/num_samples"] for r in rewound) + sum(rollout_size.get(s, 0) for s in in_flight),
    }
