"""What balanced splitting buys in the end: the slowest replica's forward/backward time over the mean, balanced vs
strided, on a long-tailed length distribution (the copy task with lengths 2..48, geometric).

    .venv/bin/python bench/bench_balance.py [--steps 20]

Two cells, same data and seed for both policies; 2 samples per prompt so that strided splitting cannot pair
each group's twins (with 8 per prompt, strided alternation alone balances the copy task).
"""

from __future__ import annotations

import argparse
import json
import statistics

from runner import OUT, run_training, table


def imbalance(rows, replicas=2, warmup=2):
    """Median over steps of max/mean per-replica forward/backward time, and of max/mean tokens."""
    times, tokens = [], []
    for r in rows[warmup:]:
        t = [r[f"cell/{i}/time_forward_backward"] for i in range(replicas)]
        n = [r[f"cell/{i}/num_tokens"] for i in range(replicas)]
        times.append(max(t) / (sum(t) / replicas))
        tokens.append(max(n) / (sum(n) / replicas))
    train = statistics.median(r["time/train"] for r in rows[warmup:])
    return statistics.median(times), statistics.median(tokens), train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    common = [f"num_steps={args.steps}", "logger=jsonl", "dp=cells", "dp.num_cells=2", "checkpoint.save_final=false",
              "task.length=48", "+task.min_length=2", "model.max_seq_len=128", "rollout.num_prompts=48",
              "rollout.n_samples_per_prompt=2", "split.attention_weight=0.01"]
    rows, out = [], {}
    for policy in ("delayed", "balanced"):
        t, n, train = imbalance(run_training(f"balance_{policy}", [*common, f"split={policy}"])["rows"])
        rows.append([policy, t, n, train])
        out[policy] = {"time_max_over_mean": t, "tokens_max_over_mean": n, "train_s": train}
    print(table(["split", "fwd/bwd time max/mean", "tokens max/mean", "train s (median)"], rows))
    (OUT / "balance.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
