"""``python -m rlfw.report RUN_DIR [--out DIR]``: PNG plots of a run directory, or a comparison of a sweep's jobs.

A run directory gives ``run.png`` (reward, loss, per-replica batch sizes, alive cells and quorum id, event
timeline), and ``episodes.md`` when its environment took several turns or called tools (turns, truncations, tool
calls and errors, the environment's time); a Hydra sweep directory gives ``sweep.png`` (every job's reward curve)
and ``sweep_summary.md``. Each PNG gets a JSON sidecar naming its panels. Output goes to ``DIR`` (default
``<RUN_DIR>/report``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlfw.report.figures import DPI, Panel, run_figure, sweep_figure
from rlfw.report.load import ReportError, is_sweep_dir, load_run, load_sweep
from rlfw.report.summary import episode_table, has_episodes, sweep_table


def write_report(source: Path, out: Path) -> list[Path]:
    """Draw the report of a run or sweep directory into ``out``; returns the files written."""
    if not source.is_dir():
        raise ReportError(f"{source}: no such directory")
    out.mkdir(parents=True, exist_ok=True)
    if is_sweep_dir(source):
        jobs = load_sweep(source)
        figure, panels = sweep_figure(jobs)
        table = out / "sweep_summary.md"
        table.write_text(sweep_table(jobs), encoding="utf-8")
        return [*_save(figure, panels, out / "sweep.png"), table]
    run = load_run(source)
    figure, panels = run_figure(run)
    written = _save(figure, panels, out / "run.png")
    if has_episodes(run):  # a multi-turn environment or tools: what the episodes did
        written.append(out / "episodes.md")
        written[-1].write_text(episode_table(run), encoding="utf-8")
    return written


def _save(figure, panels: list[Panel], path: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    width, height = (round(inches * DPI) for inches in figure.get_size_inches())
    sidecar = path.with_suffix(".json")
    sidecar.write_text(
        json.dumps({"image": path.name, "size": [width, height], "panels": [p.as_dict() for p in panels]}, indent=2)
        + "\n",
        encoding="utf-8",
    )
    return [path, sidecar]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfw.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory or a Hydra sweep directory")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.run_dir, args.out or args.run_dir / "report")
    except ReportError as error:
        print(f"rlfw.report: error: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
