"""Learning benchmark: the default run's reward curve, time to the first step, time to a mean reward of 0.8 (over
10 steps), the final reward, wall time, and the steps that trained nothing: a gradient norm of 0 (every group's
samples scored alike, so every advantage was 0). With them, the means over the run of what tells a flat curve's cause:
the share of groups whose samples scored alike, the response length, the engine's and the trainer's log-prob gap and
the share of clipped tokens. Not the loss: on-policy, the token-mean loss of zero-mean advantages
is 0 whenever every response has the same length, while its gradient is not.

    .venv/bin/python bench/bench_learning.py [--steps 200] [--name learning] [OVERRIDE ...]

``--name`` names the run's directory and summary (``outputs/bench/<name>``, ``<name>.json``), so that several runs
(other settings, other devices) can go side by side.
"""

from __future__ import annotations

import argparse
import json
from statistics import mean

from runner import OUT, run_training, table

DIAGNOSTICS = ("rollout/response_len", "rollout/logprob_abs_diff", "train/clip_frac", "train/grad_norm")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--name", default="learning")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run = run_training(args.name, [f"num_steps={args.steps}", "logger=jsonl", *args.overrides])
    rows = run["rows"]
    window = 10
    curve = []
    for start in range(0, len(rows), max(len(rows) // 10, 1)):
        chunk = rows[start:start + window]
        curve.append([chunk[0]["step"], sum(r["reward/mean"] for r in chunk) / len(chunk), chunk[-1]["time/elapsed"]])
    print(table(["step", f"reward/mean (avg of {window} steps)", "elapsed s"], curve))
    first = sum(r["reward/mean"] for r in rows[:window]) / window
    last = sum(r["reward/mean"] for r in rows[-window:]) / window
    reached = next((r for i, r in enumerate(rows[window - 1:]) if
                    sum(x["reward/mean"] for x in rows[i:i + window]) / window >= 0.8), None)
    summary = {"steps": len(rows), "reward_first10": first, "reward_last10": last,
               "first_step_s": run["first_step_s"],
               "step_at_0.8": reached["step"] if reached else None,
               "elapsed_at_0.8_s": reached["time/elapsed"] if reached else None,
               "steps_without_gradient": sum(r["train/grad_norm"] == 0 for r in rows), "wall_s": run["wall_s"],
               "zero_variance_share": mean(r["rollout/zero_variance_groups"] / r["rollout/num_groups"] for r in rows),
               **{key: mean(r[key] for r in rows) for key in DIAGNOSTICS}}
    print(table(list(summary), [list(summary.values())]))
    (OUT / f"{args.name}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
