"""The sweep's summary table (markdown): per job its overrides, status, final and last-10 reward, wall time."""

from __future__ import annotations

import math

from rlfw.report.load import SweepJob, varying_overrides
from rlfw.run_files import describe_failure

LAST_N = 10  # steps averaged for the "last-10" reward, which is steadier than the final step's


def sweep_table(jobs: list[SweepJob]) -> str:
    """A markdown table, one row per job in job order; failed jobs say so and why."""
    labels = varying_overrides(jobs)
    lines = [
        f"| job | overrides | status | final reward | last-{LAST_N} reward | wall time (s) | error |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    for job in jobs:
        final = job.run.final("reward/mean") if job.run else math.nan
        last = job.run.last_mean("reward/mean", LAST_N) if job.run else math.nan
        error = describe_failure(job.failure) if job.failure else ""
        cells = [
            str(job.number),
            f"`{labels[job.number]}`",
            "failed" if job.failed else "ok",
            _number(final, ".4f"),
            _number(last, ".4f"),
            _number(job.wall_s, ".1f"),
            error.replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    failed = sum(job.failed for job in jobs)
    lines += ["", f"{len(jobs)} jobs, {failed} failed."]
    return "\n".join(lines) + "\n"


def _number(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None and math.isfinite(value) else "–"
