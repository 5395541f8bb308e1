"""Markdown tables: a sweep's summary (per job its overrides, status, final and last-10 reward, wall time), and a
run's episodes (turns, truncations, tool calls and errors per tool, the environment's time)."""

from __future__ import annotations

import math

from rlfw.report.load import Run, SweepJob, varying_overrides
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


def has_episodes(run: Run) -> bool:
    """Whether the run's environment took more than one turn or called a tool somewhere."""
    return any(row.get("env/turns_max", 1) > 1 or any(k.startswith("env/tool_calls/") for k in row)
               for row in run.metrics)


def episode_table(run: Run) -> str:
    """The run's episodes over all its steps: turns per episode, truncated episodes by cause, per tool its calls
    and errors, the tools' seconds and the environment's share of the rollout's wall time."""
    rows = [row for row in run.metrics if "env/turns_mean" in row]
    total = lambda key: sum(row.get(key, 0) for row in rows)  # noqa: E731
    episodes = total("rollout/num_samples")
    turns = sum(row["env/turns_mean"] * row.get("rollout/num_samples", 0) for row in rows) / max(episodes, 1)
    lines = ["| quantity | value |", "|---|---:|",
             f"| steps | {len(rows)} |",
             f"| turns per episode (mean, max) | {turns:.2f}, {max(row['env/turns_max'] for row in rows):.0f} |",
             f"| truncated episodes (turn limit, token limit) | {total('env/truncated_episodes'):.0f} "
             f"({total('env/turn_limit_episodes'):.0f}, {total('env/token_limit_episodes'):.0f}) |"]
    tools = sorted({key.removeprefix("env/tool_calls/") for row in rows for key in row
                    if key.startswith("env/tool_calls/")})
    for tool in tools:
        calls, errors = total(f"env/tool_calls/{tool}"), total(f"env/tool_errors/{tool}")
        lines.append(f"| tool `{tool}`: calls, errors | {calls:.0f}, {errors:.0f} ({errors / max(calls, 1):.1%}) |")
    lines.append(f"| tool seconds | {total('env/tool_seconds'):.1f} |")
    share = [row["env/share"] for row in rows if "env/share" in row]
    lines.append(f"| environment share of the rollout (mean) | {sum(share) / max(len(share), 1):.1%} |")
    return "\n".join(lines) + "\n"


def _number(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None and math.isfinite(value) else "–"
