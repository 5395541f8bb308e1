"""Read a run directory (or a Hydra sweep of them) back into plain series for the report.

The files are the ones ``JsonlLogger`` writes: ``metrics.jsonl`` (one ``{"step", **metrics}`` per step),
``events.jsonl`` (``{"step", "kind", "time", **fields}``), plus the ``config.yaml`` the run used and, for a sweep
job that raised, the ``FAILED`` file ``rlfw.sweep`` writes (names and reader: ``rlfw.run_files``). Parsing is strict: a report drawn from a silently
skipped line would be wrong without saying so, so every bad line fails with its file and line number.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlfw.run_files import CONFIG, EVENTS, FAILED, METRICS, SWEEP_SUMMARY, RecordError, read_failure, read_jsonl

# Per-replica batch sizes: ``cell/<id>/...`` with dp=cells, ``dp/<rank>/...`` with dp=classic.
REPLICA_KEY = re.compile(r"^(cell|dp)/(\d+)/(num_samples|num_tokens)$")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # how JsonlLogger writes them


class ReportError(ValueError):
    """A run or sweep directory the report cannot be drawn from; the message names the file (and line)."""


@dataclass
class Run:
    """One run directory: its metrics by step, its events, its resolved config and, if it failed, why."""

    path: Path
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    failure: dict[str, Any] | None = None

    @property
    def steps(self) -> list[int]:
        return [row["step"] for row in self.metrics]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """The steps that logged ``key`` and its values there (non-finite values as floats)."""
        points = [(row["step"], _number(row[key])) for row in self.metrics if key in row]
        return [step for step, _ in points], [value for _, value in points]

    def replica_series(self, quantity: str) -> dict[str, list[float]]:
        """``quantity`` (``num_samples`` or ``num_tokens``) per replica, aligned with ``steps``.

        A replica absent at a step (a dead cell, a replacement not yet joined) trained nothing there: 0.
        """
        replicas = sorted(
            {(m[1], int(m[2])) for row in self.metrics for key in row if (m := REPLICA_KEY.match(key))},
            key=lambda pair: pair[1],
        )
        return {
            f"{prefix}/{index}": [_number(row.get(f"{prefix}/{index}/{quantity}", 0)) for row in self.metrics]
            for prefix, index in replicas
        }

    def final(self, key: str) -> float:
        _, values = self.series(key)
        return values[-1] if values else math.nan

    def last_mean(self, key: str, count: int) -> float:
        values = [v for v in self.series(key)[1][-count:] if math.isfinite(v)]
        return sum(values) / len(values) if values else math.nan


@dataclass
class SweepJob:
    """One job of a Hydra multirun: its directory, overrides and run (None when it left no metrics)."""

    path: Path
    number: int
    overrides: list[str]
    run: Run | None
    failure: dict[str, Any] | None
    wall_s: float | None

    @property
    def failed(self) -> bool:
        return self.failure is not None


def read_records(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every line of a JSONL file as a dict holding ``required`` keys; a bad line names its file and number."""
    try:
        return read_jsonl(path, required, check=_integer_step)
    except RecordError as error:
        raise ReportError(str(error)) from None


def _integer_step(record: dict[str, Any]) -> str | None:
    step = record["step"]
    return None if isinstance(step, int) and not isinstance(step, bool) else f"'step' must be an integer, got {step!r}"


def load_run(path: str | Path) -> Run:
    """Load one run directory; it must hold a non-empty ``metrics.jsonl``."""
    path = Path(path)
    metrics_path = path / METRICS
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path}: no such file; is {path} a run directory?")
    metrics = read_records(metrics_path, ("step",))
    if not metrics:
        raise ReportError(f"{metrics_path}: empty; the run logged no step")
    events_path = path / EVENTS
    events = read_records(events_path, ("step", "kind")) if events_path.is_file() else []
    return Run(path, metrics, events, _read_config(path / CONFIG), read_failure(path))


def is_sweep_dir(path: str | Path) -> bool:
    """A Hydra multirun directory: ``multirun.yaml`` or the summary at its top, job directories below."""
    path = Path(path)
    return not (path / METRICS).exists() and (
        (path / "multirun.yaml").exists() or (path / SWEEP_SUMMARY).exists() or bool(_job_dirs(path))
    )


def load_sweep(path: str | Path) -> list[SweepJob]:
    """Every job of a sweep directory, in job order. A job that failed keeps its metrics, if it logged any."""
    path = Path(path)
    job_dirs = _job_dirs(path)
    if not job_dirs:
        raise ReportError(f"{path}: no job directories (each with .hydra/ or {METRICS}) in this sweep")
    summary = _read_summary(path / SWEEP_SUMMARY)
    jobs = []
    for number, job_dir in job_dirs:
        failure = read_failure(job_dir)
        run = load_run(job_dir) if (job_dir / METRICS).is_file() else None
        if run is None and failure is None:
            failure = {"type": "NoMetrics", "message": f"{job_dir / METRICS} does not exist"}
        recorded = summary.get(job_dir.name, {})
        wall_s = recorded.get("wall_s")
        if wall_s is None and failure is not None:
            wall_s = failure.get("wall_s")
        if wall_s is None and run is not None:
            wall_s = run.final("time/elapsed")
        jobs.append(SweepJob(job_dir, number, _overrides(job_dir), run, failure, _finite_or_none(wall_s)))
    return jobs


def varying_overrides(jobs: list[SweepJob]) -> dict[int, str]:
    """Each job's label: the overrides that differ between jobs (all of them when there is one job)."""
    shared = set.intersection(*(set(job.overrides) for job in jobs)) if len(jobs) > 1 else set()
    return {
        job.number: ",".join(o for o in job.overrides if o not in shared) or job.path.name for job in jobs
    }


def _job_dirs(path: Path) -> list[tuple[int, Path]]:
    """Sub-directories that are sweep jobs, numbered by the ``<n>_`` prefix Hydra's sweep subdir gives them."""
    jobs = []
    for child in path.iterdir() if path.is_dir() else []:
        if not child.is_dir() or not any((child / name).exists() for name in (".hydra", METRICS, FAILED)):
            continue
        prefix = child.name.split("_", 1)[0]
        jobs.append((int(prefix) if prefix.isdigit() else len(jobs), child))
    return sorted(jobs)


def _overrides(job_dir: Path) -> list[str]:
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    if overrides_file.is_file():
        return [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []]
    name = job_dir.name.split("_", 1)
    return name[1].split(",") if len(name) == 2 else []


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ReportError(f"{path}: not valid YAML ({error})") from None
    return config if isinstance(config, dict) else {}


def _read_summary(path: Path) -> dict[str, dict[str, Any]]:
    """``sweep_summary.json`` keyed by job directory name; empty when the sweep wrote none."""
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ReportError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    return {Path(job["dir"]).name: job for job in summary.get("jobs", [])}


def _number(value: Any) -> float:
    if isinstance(value, str):
        return _NON_FINITE.get(value, math.nan)
    return float(value) if isinstance(value, int | float) else math.nan


def _finite_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None
