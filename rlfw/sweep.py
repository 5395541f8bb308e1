"""Hydra multirun: one failing job must not end the sweep, and the sweep must say which jobs failed.

Hydra's basic launcher runs the jobs one after another in one process, so an exception escaping a job would kill
every job after it. ``run_sweep_job`` contains it instead: the job's run directory gets a ``FAILED`` file (type,
message, traceback), Ray is shut down so the next job starts on a clean cluster, and the job returns NaN.
``SweepCallback`` (registered under ``hydra.callbacks`` in ``conf/config.yaml``) records each job's outcome, writes
``<sweep_dir>/sweep_summary.json`` once every job ran, and makes the process exit non-zero if any job failed.

With ``hydra/launcher=ray`` the jobs run as Ray tasks; the callback then starts rlfw's own Ray instance first
(loopback, rlfw's worker environment) so the launcher and every job use that one cluster.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict, read_write

from rlfw.run_files import FAILED, OUTCOME, SWEEP_SUMMARY, describe_failure, read_failure, write_failure

log = logging.getLogger("rlfw.sweep")

RAY_LAUNCHER = "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
T = TypeVar("T")


def run_sweep_job(job: Callable[[], T], run_dir: Path) -> T | None:
    """Run one sweep job; an exception fails this job only (FAILED file, Ray shut down) and gives None."""
    from rlfw.cluster.ray_cluster import stop_ray

    (run_dir / FAILED).unlink(missing_ok=True)  # left by an earlier attempt in this directory
    started = time.time()
    try:
        return job()
    except Exception as error:  # any error, config errors included, fails this job only
        log.exception("sweep job in %s failed", run_dir)
        path = write_failure(run_dir, error, time.time() - started)
        log.error("recorded in %s; the sweep goes on with the next job", path)
        stop_ray()
        return None


class SweepCallback(Callback):
    """Outcome of every multirun job, ``sweep_summary.json`` at the end, a non-zero exit if any job failed.

    Each job writes its outcome to a file (``.hydra/outcome.json`` in its output directory) rather than to this
    object, because with the Ray launcher ``on_job_end`` runs in a Ray worker, on a copy of the callback.
    """

    def __init__(self) -> None:
        self._sweep_started = 0.0
        self._job_started = 0.0
        self._owns_ray = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep_started = time.time()
        if config.hydra.launcher.get("_target_") == RAY_LAUNCHER:
            self._prepare_ray_launcher(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._job_started = time.time()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        output_dir = Path(config.hydra.runtime.output_dir)
        run_dir = Path(config.get("run_dir") or output_dir)
        failure = read_failure(run_dir)
        reward = None
        try:
            reward = job_return.return_value  # re-raises what escaped the job (run_sweep_job lets nothing out)
        except Exception as error:
            log.exception("sweep job %s raised past rlfw", output_dir.name)
            failure = failure or {"type": type(error).__name__, "message": str(error)}
        outcome = {
            "num": int(config.hydra.job.num),
            "dir": str(output_dir),
            "run_dir": str(run_dir),
            "overrides": list(job_return.overrides or []),
            "status": "failed" if failure is not None else "ok",
            "reward": reward if isinstance(reward, int | float) and math.isfinite(reward) else None,
            "wall_s": time.time() - self._job_started,
            "started": self._job_started,
            "error": describe_failure(failure) if failure is not None else None,
        }
        (output_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        path = output_dir / ".hydra" / OUTCOME
        partial = path.with_name(path.name + ".partial")  # whole or not at all: the sweep's summary reads it
        partial.write_text(json.dumps(outcome, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, path)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = self._outcomes(sweep_dir)
        failed = [job for job in jobs if job["status"] == "failed"]
        summary = {"sweep_dir": str(sweep_dir), "num_jobs": len(jobs), "num_failed": len(failed), "jobs": jobs}
        path = sweep_dir / SWEEP_SUMMARY
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if self._owns_ray:
            from rlfw.cluster.ray_cluster import stop_ray

            stop_ray()
        if failed:
            lines = "\n".join(f"  {Path(job['dir']).name}: {job['error']}" for job in failed)
            log.error("%d of %d sweep jobs failed (see %s):\n%s", len(failed), len(jobs), path, lines)
            sys.exit(1)
        log.info("all %d sweep jobs finished; summary in %s", len(jobs), path)

    def _outcomes(self, sweep_dir: Path) -> list[dict[str, Any]]:
        """This sweep's job outcomes, by job number (outcomes left by an earlier sweep into the same dir are not)."""
        jobs = []
        for path in sweep_dir.glob(f"**/.hydra/{OUTCOME}"):
            try:
                outcome = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:  # not one this sweep wrote (those are renamed into place whole)
                log.warning("skipping the unreadable job outcome %s: %s", path, e)
                continue
            if outcome.get("started", 0.0) >= self._sweep_started:
                jobs.append(outcome)
        return sorted(jobs, key=lambda job: job["num"])

    def _prepare_ray_launcher(self, config: DictConfig) -> None:
        """Start rlfw's Ray before the launcher would start a default one, and let each job hold no CPU.

        A job is only the driver of its run: its trainer ranks and engines reserve their own CPUs. Ray's default
        of one CPU per task would let two jobs take both CPUs of a small machine and starve their own actors.
        """
        from rlfw.cluster.ray_cluster import start_ray

        start_ray(config.cluster)
        self._owns_ray = True
        with read_write(config.hydra.launcher), open_dict(config.hydra.launcher):
            config.hydra.launcher.ray.remote.setdefault("num_cpus", 0)
