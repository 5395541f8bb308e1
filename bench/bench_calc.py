"""The calc tool task learned from scratch: as shipped, without the calculator, and without turn-level credit.

    .venv/bin/python bench/bench_calc.py [--steps 250] [overrides...]

Every run is the default job (2 cells, the local engine, the tiny model) on task=calc; the second sets
task.tools=[] (every call an error observation), the third algo.turn_discount=null (every token of an episode
credited with the episode's reward). Prints the reward curve of each and a summary: the mean reward of the first
and last 10 steps, the minutes to the first 10-step mean above 0.7, what each turn earned over the last 10 steps,
the tool calls and errors per episode, the environment's share of the rollout.
"""

from __future__ import annotations

import argparse
import json

from runner import OUT, run_training, table


def summary(rows: list[dict], wall_s: float) -> dict:
    window = 10
    means = [sum(r["reward/mean"] for r in rows[i - window:i]) / window for i in range(window, len(rows) + 1)]
    reached = next((i for i, m in enumerate(means) if m > 0.7), None)
    episodes = sum(r["rollout/num_samples"] for r in rows)
    return {
        "reward_first10": means[0], "reward_last10": means[-1],
        "min_to_0.7": round(rows[reached + window - 1]["time/elapsed"] / 60, 2) if reached is not None else "-",
        "turns": sum(r["env/turns_mean"] for r in rows[-window:]) / window,
        "call_earned": sum(r.get("env/turn_reward/0", 0.0) for r in rows[-window:]) / window,
        "answer_earned": sum(r.get("env/turn_reward/1", 0.0) for r in rows[-window:]) / window,
        "calls/episode": sum(r.get("env/tool_calls/calc", 0) + r.get("env/tool_calls/unknown", 0)
                             for r in rows[-window:]) / sum(r["rollout/num_samples"] for r in rows[-window:]),
        "errors/call": sum(r.get("env/tool_errors/calc", 0) + r.get("env/tool_errors/unknown", 0) for r in rows)
        / max(1, sum(r.get("env/tool_calls/calc", 0) + r.get("env/tool_calls/unknown", 0) for r in rows)),
        "env_share": sum(r["env/share"] for r in rows) / len(rows),
        "episodes": episodes, "wall_min": round(wall_s / 60, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {}
    for name, extra in (("tool", []), ("no_tool", ["task.tools=[]"]), ("episode_credit", ["algo.turn_discount=null"])):
        run = run_training(f"calc_{name}", ["task=calc", f"num_steps={args.steps}", "logger=jsonl", *extra,
                                             *args.overrides])
        rows = [r for r in run["rows"] if "reward/mean" in r]
        every = max(1, len(rows) // 10)
        curve = [[r["step"], r["reward/mean"], round(r["time/elapsed"] / 60, 2)] for r in rows[::every]]
        print(f"\n{name}\n" + table(["step", "reward/mean", "elapsed min"], curve))
        results[name] = summary(rows, run["wall_s"])
    print("\n" + table(["run", *results["tool"]], [[name, *s.values()] for name, s in results.items()]))
    (OUT / "calc.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
