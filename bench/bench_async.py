"""Synchronous vs asynchronous RL, side by side: the same task, seeds and step budget for ``loop=sync`` and
``loop=async`` (``loop.max_staleness``), runs interleaved seed by seed so both see the same machine.

    .venv/bin/python bench/bench_async.py [--steps 200] [--seeds 1 2 3] [--staleness 1] [hydra overrides...]

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

from runner import OUT, run_training, table

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    modes = {"sync": ["loop=sync"], "async": ["loop=async", f"loop.max_staleness={args.staleness}"]}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for seed in args.seeds:
        for mode, overrides in modes.items():
            run = run_training(f"async_{mode}_seed{seed}",
                               [f"num_steps={args.steps}", f"seed={seed}", "logger=jsonl", *overrides, *args.overrides])
            runs[mode].append({"seed": seed, "wall_s": run["wall_s"], **summarise(run["rows"], args.target)})

    keys = ["samples_per_s", "step_to_target", "s_to_target", "final_reward", "engine_busy", "trainer_busy",
            "staleness", "partial_frac", "step_s", "wall_s"]
    show = lambda v: "-" if v is None else v  # noqa: E731
    print(table(["mode", "seed", *keys], [[mode, r["seed"], *(show(r[k]) for k in keys)]
                                          for mode in modes for r in runs[mode]]))

    def mean(mode, key):
        values = [r[key] for r in runs[mode] if r[key] is not None]
        return statistics.mean(values) if len(values) == len(runs[mode]) else None

    sync_finals = [r["final_reward"] for r in runs["sync"]]
    summary = {
        "samples/s sync": mean("sync", "samples_per_s"), "samples/s async": mean("async", "samples_per_s"),
        "speed-up": mean("async", "samples_per_s") / mean("sync", "samples_per_s"),
        f"s to {args.target} sync": show(mean("sync", "s_to_target")),
        f"s to {args.target} async": show(mean("async", "s_to_target")),
        "final reward sync (min..max)":
            f"{statistics.mean(sync_finals):.3f} ({min(sync_finals):.3f}..{max(sync_finals):.3f})",
        "final reward async": mean("async", "final_reward"),
        "async within sync spread": min(sync_finals) <= mean("async", "final_reward") <= max(sync_finals),
    }
    print(table(list(summary), [list(summary.values())]))
    (OUT / "async.json").write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1,
                                               default=str))


if __name__ == "__main__":
    main()
