"""Advantage estimators side by side: reward curves on the built-in task, same seed and step budget for each.

    .venv/bin/python bench/bench_algos.py [--steps 60] [--algos grpo rloo reinforce_pp reinforce_pp:baseline=group_mean ppo]
                                          [hydra overrides...]

An entry of ``--algos`` is ``name`` (``algo=name``) or ``name:key=value,key=value`` (plus ``algo.key=value``).
The runs go one after another (the machine's cores are shared); each row is one run.
"""

from __future__ import annotations

import argparse
import json

from runner import OUT, run_training, table

DEFAULT_ALGOS = ["grpo", "rloo", "reinforce_pp", "reinforce_pp:baseline=group_mean", "ppo"]


def algo_overrides(spec: str) -> list[str]:
    """``reinforce_pp:baseline=group_mean`` -> ``["algo=reinforce_pp", "algo.baseline=group_mean"]``."""
    name, _, options = spec.partition(":")
    return [f"algo={name}", *(f"algo.{option}" for option in options.split(",") if option)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=25, help="report the reward every this many steps")
    parser.add_argument("--algos", nargs="+", default=DEFAULT_ALGOS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (e.g. seed=3)")
    args = parser.parse_args()
    marks = [*range(0, args.steps - 1, args.every), args.steps - 1]
    rows, summary = [], {}
    for spec in args.algos:
        name = "algos_" + spec.replace(":", "_").replace(",", "_").replace("=", "-")
        run = run_training(name, [f"num_steps={args.steps}", "logger=jsonl", *algo_overrides(spec), *args.overrides])
        reward = {r["step"]: r["reward/mean"] for r in run["rows"]}
        last10 = [reward[s] for s in sorted(reward)[-10:]]
        summary[spec] = {"reward": reward, "last10_mean": sum(last10) / len(last10), "wall_s": run["wall_s"]}
        rows.append([spec, *(reward.get(s, float("nan")) for s in marks), summary[spec]["last10_mean"],
                     run["wall_s"]])
    print(table(["algo", *(f"step {s}" for s in marks), "last-10 mean", "wall s"], rows))
    (OUT / "algos.json").write_text(json.dumps({"steps": args.steps, "overrides": args.overrides, "runs": summary},
                                               indent=1))


if __name__ == "__main__":
    main()
