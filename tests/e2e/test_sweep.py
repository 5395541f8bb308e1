"""Hydra multirun: `python -m rlfw.train -m ...` runs each job in its own run directory; a failing job is recorded
and the others still run; with `hydra/launcher=ray` the jobs are tasks on one Ray cluster.

One sweep asserts both (each sweep job is a whole rlfw run, most of whose time is start-up): with the Ray launcher
a failed job's Ray task ends and the job beside it trains on the same cluster. (With the basic launcher, a failed
job's ``train`` stops the Ray it started, as every run does: tests/config/test_sweep_outcomes.py holds the job's
failure record.)"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from harness import read_jsonl

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["num_steps=2", "logger=jsonl", "rollout.num_prompts=4"]


def multirun(sweep_dir: Path, *overrides) -> subprocess.CompletedProcess:
    """The sweep's Ray workers import the e2e folder's tasks: ``shared_ray`` put it on PYTHONPATH."""
    cmd = [sys.executable, "-m", "rlfw.train", "-m", *overrides, *SMALL, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)


def failures(sweep_dir: Path, result: subprocess.CompletedProcess) -> str:
    """What went wrong, for an assertion message: the failed jobs' errors, else the tail of the output."""
    path = sweep_dir / "sweep_summary.json"
    if path.exists():
        return "\n".join(f"{job['dir']}: {job['error']}" for job in json.loads(path.read_text())["jobs"]
                         if job["status"] == "failed")
    return (result.stdout + result.stderr)[-3000:]


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("_", 1)[0]))


def summary(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())


def test_ray_launcher_runs_jobs_as_tasks_on_one_cluster_and_a_failing_job_does_not_stop_the_sweep(tmp_path):
    """The sweep extra is installed by `make test`: this test runs in CI. Job 0's reward function raises inside a
    Ray actor; job 1 runs on the same cluster and trains, and the sweep records both outcomes."""
    tasks = "task._target_=crashing_task.CrashingTask,rlfw.rollout.tasks.copy.CopyTask"
    result = multirun(tmp_path, "hydra/launcher=ray", tasks, "dp=cells")
    assert result.returncode == 1, failures(tmp_path, result)
    assert "Ray is already running" in result.stdout  # the launcher used rlfw's cluster
    assert "1 of 2 sweep jobs failed" in result.stdout  # Hydra logs to stdout

    crashed, completed = job_dirs(tmp_path)
    failure = json.loads((crashed / "FAILED").read_text())
    assert "reward function exploded" in failure["message"]
    assert "Traceback" in failure["traceback"] and failure["type"] and failure["wall_s"] > 0
    assert not (completed / "FAILED").exists()
    metrics = read_jsonl(completed / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1]
    assert "cell/1/num_samples" in metrics[0]

    done = summary(tmp_path)
    assert (done["num_jobs"], done["num_failed"]) == (2, 1)
    failed_job, ok_job = done["jobs"]
    assert (failed_job["status"], failed_job["reward"]) == ("failed", None)
    assert "reward function exploded" in failed_job["error"]
    assert failed_job["overrides"][0] == "task._target_=crashing_task.CrashingTask"
    assert (ok_job["status"], ok_job["error"]) == ("ok", None)
    assert ok_job["overrides"][:2] == ["task._target_=rlfw.rollout.tasks.copy.CopyTask", "dp=cells"]
    assert ok_job["reward"] == metrics[-1]["reward/mean"] and math.isfinite(ok_job["reward"])
