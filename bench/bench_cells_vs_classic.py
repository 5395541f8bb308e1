"""Step time of dp=cells against dp=classic on the same data, side by side, as a ratio, and where it goes.

    .venv/bin/python bench/bench_cells_vs_classic.py [--steps 30]

Both modes train the same model on the same rollouts (same seed), 2 replicas each. The train phase (log-probs
excluded) is compared: median over steps after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics

from runner import OUT, run_training, table

MODELS = {
    "tiny": [],
    "small": ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=1024",
              "model.num_attention_heads=8", "model.num_query_groups=4", "model.max_seq_len=64"],
}


def median(rows, key, warmup=3):
    values = [r[key] for r in rows[warmup:] if key in r]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    results, out = [], {}
    for model, overrides in MODELS.items():
        common = [f"num_steps={args.steps}", "logger=jsonl", "checkpoint.save_final=false", *overrides]
        classic = run_training(f"speed_{model}_classic", ["dp=classic", "dp.size=2", *common])["rows"]
        cells = run_training(f"speed_{model}_cells", ["dp=cells", "dp.num_cells=2", *common])["rows"]
        t_classic, t_cells = median(classic, "time/train"), median(cells, "time/train")
        row = {
            "model": model,
            "classic train s": t_classic,
            "cells train s": t_cells,
            "ratio": t_cells / t_classic,
            "cells quorum s": median(cells, "train/time/quorum"),
            "cells fwd/bwd s": median(cells, "train/time/forward_backward"),
            "cells allreduce+vote s": median(cells, "train/time/reduce_and_vote"),
            "classic fwd/bwd s": median(classic, "train/time/forward_backward"),
            "classic allreduce s": median(classic, "train/time/reduce_and_vote"),
            "same losses": all(abs(a["loss"] - b["loss"]) <= 1e-6 * max(1.0, abs(a["loss"]))
                               for a, b in zip(classic, cells)),
        }
        results.append(list(row.values()))
        out[model] = row
    print(table(list(out["tiny"]), results))
    (OUT / "cells_vs_classic.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
