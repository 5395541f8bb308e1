"""Matplotlib figures of a run (training curves, per-replica batch sizes, membership, fault timeline) and of a
sweep (every job's reward curve).

Each builder returns the figure and a description of its panels (title, plotted series, note), which the CLI
saves next to the PNG: a reader or a test can check what a picture shows without looking at pixels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only: no display, and no GUI toolkit import
import matplotlib.pyplot as plt

from rlfw.report.load import Run, SweepJob, varying_overrides

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

RUN_FIGSIZE = (15.0, 16.0)  # inches; at DPI this is the PNG's size in pixels
SWEEP_FIGSIZE = (12.0, 6.0)
DPI = 100
# One marker per event kind on the timeline; kinds beyond the list cycle through it.
EVENT_MARKERS = ("X", "o", "s", "^", "v", "D", "P", "*", "<", ">")
# Events that mark a failure on the goodput panels: a cell lost, the state restored, a restarted job.
FAILURE_KINDS = ("cell_failed", "state_restored", "resumed")


@dataclass
class Panel:
    """What one axes shows: its title, the labels of its series, and a note when there was nothing to draw."""

    title: str
    series: list[str] = field(default_factory=list)
    note: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def run_figure(run: Run) -> tuple[Figure, list[Panel]]:
    """Eight panels: reward, loss, samples and tokens per replica, alive cells and quorum id, event timeline,
    goodput and ETTR, and the MTTR of the last failure, the last two with the failures marked."""
    fig, axes = plt.subplots(4, 2, figsize=RUN_FIGSIZE, dpi=DPI, layout="constrained")
    fig.suptitle(_run_title(run))
    panels = [
        _reward_panel(axes[0, 0], run),
        _line_panel(axes[0, 1], run, "loss", "Loss"),
        _replica_panel(axes[1, 0], run, "num_samples", "Samples per replica"),
        _replica_panel(axes[1, 1], run, "num_tokens", "Response tokens per replica"),
        _membership_panel(axes[2, 0], run),
        _timeline_panel(axes[2, 1], run),
        _goodput_panel(axes[3, 0], run),
        _failure_marked(axes[3, 1], run, _line_panel(axes[3, 1], run, "ft/mttr_last_s", "MTTR of the last failure")),
    ]
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.set_xlim(_step_range(run))
        ax.xaxis.get_major_locator().set_params(integer=True)
    return fig, panels


def sweep_figure(jobs: list[SweepJob]) -> tuple[Figure, list[Panel]]:
    """Reward curve of every job, labelled by the overrides that set it apart; failed jobs dashed."""
    fig, ax = plt.subplots(figsize=SWEEP_FIGSIZE, dpi=DPI, layout="constrained")
    labels = varying_overrides(jobs)
    panel = Panel("Reward (mean) per sweep job")
    ax.set_title(panel.title)
    for job in jobs:
        label = labels[job.number] + (" (failed)" if job.failed else "")
        if job.run is None:
            panel.series.append(label)
            ax.plot([], [], linestyle="none", label=f"{label}: no metrics")  # listed, nothing to draw
            continue
        steps, values = job.run.series("reward/mean")
        ax.plot(steps, values, linestyle="--" if job.failed else "-", marker=".", label=label)
        panel.series.append(label)
    ax.set_xlabel("step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("reward/mean")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return fig, [panel]


def _reward_panel(ax: Axes, run: Run) -> Panel:
    panel = Panel("Reward (mean ± std)")
    ax.set_title(panel.title)
    steps, mean = run.series("reward/mean")
    if not steps:
        return _empty(ax, panel, "no 'reward/mean' in metrics.jsonl")
    ax.plot(steps, mean, marker=".", label="reward/mean")
    panel.series.append("reward/mean")
    std_steps, std = run.series("reward/std")
    if std_steps == steps:
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        alpha=0.25, label="± reward/std")
        panel.series.append("± reward/std")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return panel


def _line_panel(ax: Axes, run: Run, key: str, title: str) -> Panel:
    panel = Panel(title)
    ax.set_title(title)
    steps, values = run.series(key)
    if not steps:
        return _empty(ax, panel, f"no {key!r} in metrics.jsonl")
    non_finite = [step for step, value in zip(steps, values) if not math.isfinite(value)]
    ax.plot(steps, values, marker=".", label=key)
    panel.series.append(key)
    if non_finite:
        panel.note = f"non-finite at steps {non_finite}"
        ax.text(0.02, 0.95, panel.note, transform=ax.transAxes, va="top", color="red", fontsize="small")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    return panel


def _replica_panel(ax: Axes, run: Run, quantity: str, title: str) -> Panel:
    """Stacked bars: each replica's share, so the bar's height is the step's global batch."""
    panel = Panel(title)
    ax.set_title(title)
    per_replica = run.replica_series(quantity)
    if not per_replica:
        return _empty(ax, panel, f"no cell/<id>/{quantity} or dp/<rank>/{quantity} in metrics.jsonl")
    bottom = [0.0] * len(run.steps)
    for replica, values in per_replica.items():
        ax.bar(run.steps, values, bottom=bottom, width=0.8, label=replica)
        bottom = [b + v for b, v in zip(bottom, values)]
    panel.series.extend(per_replica)
    ax.set_ylabel(quantity)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", ncols=min(len(per_replica), 4))
    return panel


def _membership_panel(ax: Axes, run: Run) -> Panel:
    panel = Panel("Alive cells and quorum id")
    ax.set_title(panel.title)
    alive_steps, alive = run.series("cells/alive")
    quorum_steps, quorum = run.series("ft/quorum_id")
    if not alive_steps and not quorum_steps:
        return _empty(ax, panel, "no cells/alive or ft/quorum_id: a classic run has one world and no membership")
    lines = []
    if alive_steps:
        lines += ax.step(alive_steps, alive, where="post", color="tab:green", label="cells/alive")
        ax.set_ylabel("cells/alive")
        ax.set_ylim(0, _finite_max(alive) + 1)  # from 0, so a drop reads as the share of cells lost
        ax.yaxis.get_major_locator().set_params(integer=True)
        panel.series.append("cells/alive")
    if quorum_steps:  # on its own axis: it only grows, while the cell count stays small
        twin = ax.twinx()
        lines += twin.step(quorum_steps, quorum, where="post", color="tab:purple", linestyle="--", label="ft/quorum_id")
        twin.set_ylabel("ft/quorum_id")
        twin.set_ylim(0, _finite_max(quorum) + 1)
        twin.yaxis.get_major_locator().set_params(integer=True)
        panel.series.append("ft/quorum_id")
    ax.legend(handles=lines, loc="lower left", fontsize="small")
    ax.grid(alpha=0.3)
    return panel


def _timeline_panel(ax: Axes, run: Run) -> Panel:
    """One row per event kind, a marker at each event's step: failures, re-splits, quorum changes, joins, heals."""
    panel = Panel("Events")
    ax.set_title(panel.title)
    kinds = list(dict.fromkeys(event["kind"] for event in run.events))
    if not kinds:
        ax.set_yticks([])
        return _empty(ax, panel, "no events recorded (events.jsonl is absent or empty)")
    for row, kind in enumerate(kinds):
        steps = [event["step"] for event in run.events if event["kind"] == kind]
        ax.scatter(steps, [row] * len(steps), marker=EVENT_MARKERS[row % len(EVENT_MARKERS)], s=60,
                   label=f"{kind} ({len(steps)})", zorder=3)
        panel.series.append(kind)
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_ylim(-0.5, len(kinds) - 0.5)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return panel


def _goodput_panel(ax: Axes, run: Run) -> Panel:
    """Goodput (committed samples per wall second) and ETTR (0..1, its own axis), both over the whole run."""
    panel = Panel("Goodput and ETTR")
    ax.set_title(panel.title)
    steps, goodput = run.series("ft/goodput")
    ettr_steps, ettr = run.series("ft/ettr")
    if not steps:
        return _empty(ax, panel, "no ft/goodput in metrics.jsonl")
    lines = ax.plot(steps, goodput, marker=".", color="tab:blue", label="ft/goodput")
    ax.set_ylabel("samples / s")
    ax.set_ylim(0, _finite_max(goodput) * 1.1 or 1)
    panel.series.append("ft/goodput")
    if ettr_steps:
        twin = ax.twinx()
        lines += twin.plot(ettr_steps, ettr, marker=".", color="tab:orange", label="ft/ettr")
        twin.set_ylabel("ETTR")
        twin.set_ylim(0, 1.05)
        panel.series.append("ft/ettr")
    ax.legend(handles=lines, loc="lower left", fontsize="small")
    ax.grid(alpha=0.3)
    return _failure_marked(ax, run, panel)


def _failure_marked(ax: Axes, run: Run, panel: Panel) -> Panel:
    """A dotted red line at every failure's step (``FAILURE_KINDS``), listed in the panel's series."""
    steps = sorted({event["step"] for event in run.events if event["kind"] in FAILURE_KINDS})
    for step in steps:
        ax.axvline(step, color="tab:red", linestyle=":", alpha=0.7)
    if steps:
        panel.series.append(f"failures at steps {steps}")
    return panel


def _empty(ax: Axes, panel: Panel, note: str) -> Panel:
    panel.note = note
    ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", wrap=True, color="gray")
    return panel


def _finite_max(values: list[float]) -> float:
    return max((v for v in values if math.isfinite(v)), default=0.0)


def _step_range(run: Run) -> tuple[float, float]:
    steps = run.steps + [event["step"] for event in run.events]
    low, high = min(steps), max(steps)
    return low - 0.5, high + 0.5


def _run_title(run: Run) -> str:
    dp = run.config.get("dp", {})
    if dp.get("mode") == "cells":
        layout = f"dp=cells ({dp.get('num_cells')} cells)"
    elif dp.get("mode") == "classic":
        layout = f"dp=classic (size {dp.get('size')})"
    else:
        layout = "config.yaml not found"
    split = run.config.get("split", {}).get("name")
    title = f"{run.path.name}: {layout}" + (f", split={split}" if split else "") + f", {len(run.metrics)} steps"
    if run.failure is not None:
        title += f" (FAILED: {run.failure.get('type', '')})"
    return title
