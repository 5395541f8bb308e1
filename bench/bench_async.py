"""Synchronous vs asynchronous RL, side by side: the same task, seeds and step budget for ``loop=sync`` and
``loop=async`` (``loop.max_staleness``), runs interleaved seed by seed so both see the same machine.

    .venv/bin/python bench/bench_async.py [--steps 200] [--seeds 1 2 3] [--staleness 1] [--name async] [-- overrides...]
    .venv/bin/python bench/bench_async.py --merge outputs/bench/a.json outputs/bench/b.json   # one table of several
    .venv/bin/python bench/bench_async.py --collect --seeds 1 --name a     # the table of runs already made

``--collect`` reads the runs' ``metrics.jsonl`` that a run of the same ``--name`` and ``--seeds`` left in
``outputs/bench/`` instead of running them (wall time then unknown): for runs whose process was stopped after
training, e.g. by a machine's time limit during shutdown.

``--merge`` prints the tables of several result files as one (seeds run by separate processes at the same time, on a
machine with cores to spare: every sync run then shares the machine with the others, as every async run does).

Per run, from its metrics.jsonl: samples trained per second over the training window (the first step's end to
the last one's, start-up left out), the step and the seconds (from the first step's end) at which the mean reward
of the last 10 steps first reaches ``--target``, the mean reward of the last 10 steps, the busy fractions of the
engines and the trainer, and the mean staleness. The summary compares the means over seeds; "same reward" means
the async runs' mean final reward lies within the spread (min..max) of the sync seeds' (as the goal defines it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from runner import OUT, read_jsonl, run_training, table

WINDOW = 10


def summarise(rows: list[dict], target: float) -> dict:
    """The figures of one run (see the module docstring)."""
    first, last = rows[0], rows[-1]
    window_s = last["time/elapsed"] - first["time/elapsed"]
    samples = sum(r["train/num_samples"] for r in rows[1:])
    reached = next((i for i in range(WINDOW - 1, len(rows))
                    if statistics.mean(r["reward/mean"] for r in rows[i - WINDOW + 1:i + 1]) >= target), None)
    mean = lambda key: statistics.mean(r[key] for r in rows[1:]) if key in last else float("nan")  # noqa: E731
    return {
        "samples_per_s": samples / window_s,
        "step_to_target": rows[reached]["step"] if reached is not None else None,
        "s_to_target": rows[reached]["time/elapsed"] - first["time/elapsed"] if reached is not None else None,
        "final_reward": statistics.mean(r["reward/mean"] for r in rows[-WINDOW:]),
        "engine_busy": mean("loop/engine_busy_frac"),
        "trainer_busy": mean("loop/trainer_busy_frac"),
        "staleness": mean("loop/staleness_mean"),
        "partial_frac": mean("loop/partial_rollout_frac"),
        "step_s": statistics.median(r["time/step"] for r in rows[1:]),
    }


def run(args) -> dict[str, list[dict]]:
    """Both modes for every seed, interleaved; the summaries of each run (``--collect``: of the runs on disk)."""
    modes = {"sync": ["loop=sync"], "async": ["loop=async", f"loop.max_staleness={args.staleness}"]}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for seed in args.seeds:
        for mode, overrides in modes.items():
            name = f"{args.name}_{mode}_seed{seed}"
            if args.collect:
                result = {"rows": read_jsonl(OUT / name / "metrics.jsonl"), "wall_s": None}
            else:
                result = run_training(name, [f"num_steps={args.steps}", f"seed={seed}", "logger=jsonl", *overrides,
                                             *args.overrides])
            runs[mode].append({"seed": seed, "wall_s": result["wall_s"], **summarise(result["rows"], args.target)})
    return runs


def report(runs: dict[str, list[dict]], target: float) -> dict:
    """Print the per-run table and the comparison; returns the comparison."""
    keys = ["samples_per_s", "step_to_target", "s_to_target", "final_reward", "engine_busy", "trainer_busy",
            "staleness", "partial_frac", "step_s", "wall_s"]
    show = lambda v: "-" if v is None else v  # noqa: E731
    print(table(["mode", "seed", *keys], [[mode, r["seed"], *(show(r[k]) for k in keys)]
                                          for mode in runs for r in runs[mode]]))

    def mean(mode, key):
        values = [r[key] for r in runs[mode] if r[key] is not None]
        return statistics.mean(values) if len(values) == len(runs[mode]) else None

    def reached(mode):  # the mean over the seeds that reached the target, and how many did
        values = [r["s_to_target"] for r in runs[mode] if r["s_to_target"] is not None]
        return f"{statistics.mean(values):.1f} ({len(values)}/{len(runs[mode])} seeds)" if values else "-"

    sync_finals = [r["final_reward"] for r in runs["sync"]]
    summary = {
        "samples/s sync": mean("sync", "samples_per_s"), "samples/s async": mean("async", "samples_per_s"),
        "speed-up": mean("async", "samples_per_s") / mean("sync", "samples_per_s"),
        f"s to {target} sync": reached("sync"),
        f"s to {target} async": reached("async"),
        "final reward sync (min..max)":
            f"{statistics.mean(sync_finals):.3f} ({min(sync_finals):.3f}..{max(sync_finals):.3f})",
        "final reward async": mean("async", "final_reward"),
        "async within sync spread": min(sync_finals) <= mean("async", "final_reward") <= max(sync_finals),
    }
    print(table(list(summary), [list(summary.values())]))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--name", default="async", help="run directories and the result file are named after it")
    parser.add_argument("--merge", nargs="+", help="result files to print as one table (nothing is run)")
    parser.add_argument("--collect", action="store_true", help="summarise the runs on disk (nothing is run)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    if args.merge:
        results = [json.loads(Path(path).read_text()) for path in args.merge]
        runs = {mode: [r for result in results for r in result["runs"][mode]] for mode in ("sync", "async")}
        report(runs, results[0]["args"]["target"])
        return
    runs = run(args)
    summary = report(runs, args.target)
    (OUT / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary},
                                                      indent=1, default=str))


if __name__ == "__main__":
    main()
