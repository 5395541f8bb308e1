"""Step time of dp=cells against dp=classic on the same data, side by side, as a ratio, and where it goes.

    .venv/bin/python bench/bench_cells_vs_classic.py [--steps 30]
    python3 bench/bench_cells_vs_classic.py --gpu [--steps 12]     # on one CUDA device

Both modes train the same model on the same rollouts (same seed), 2 replicas each. The train phase (log-probs
excluded) is compared: median over steps after a warm-up. The cells run once per cross-cell transport
(``--transports``, ft.host_transport): shared memory (the default) and Gloo's TCP ring.

``--gpu``: one GPU, so classic is one replica (DP=1) with the whole batch, and cells are two one-rank cells sharing
the device (``cluster.gpus_per_worker=0.5``), each its own NCCL world, their gradients summed across cells on the
host (NCCL cannot join two processes on one GPU): through shared memory or torchft's Gloo group. The all-reduce +
vote column is that transport's share of a step.
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


GPU_MODELS = {  # bf16 on the device; the built-in task's short sequences, its small vocabulary
    "gpu 12x1024": ["model.num_layers=12", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
                    "model.num_attention_heads=16", "model.num_query_groups=4"],
}


def median(rows, key, warmup=3):
    values = [r[key] for r in rows[warmup:] if key in r]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--gpu", action="store_true", help="one CUDA device: DP=1 classic vs 2 cells sharing it")
    parser.add_argument("--transports", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo"],
                        help="the cells' ft.host_transport: one cells run each, beside the one classic run")
    args = parser.parse_args()
    results, out = [], {}
    models = GPU_MODELS if args.gpu else MODELS
    for model, overrides in models.items():
        common = [f"num_steps={args.steps}", "logger=jsonl", "checkpoint.save_final=false", *overrides]
        classic_dp, cells_dp = ["dp=classic", "dp.size=2"], ["dp=cells", "dp.num_cells=2"]
        if args.gpu:
            common += ["cluster.device=cuda", "cluster.placement=colocated"]  # the engine on the trainers' GPU
            classic_dp, cells_dp = ["dp=classic", "dp.size=1"], [*cells_dp, "cluster.gpus_per_worker=0.5"]
        name = model.replace(" ", "_")
        classic = run_training(f"speed_{name}_classic", [*classic_dp, *common])["rows"]
        t_classic = median(classic, "time/train")
        for transport in args.transports:
            cells = run_training(f"speed_{name}_cells_{transport}",
                                 [*cells_dp, *common, f"ft.host_transport={transport}"])["rows"]
            t_cells = median(cells, "time/train")
            row = {
                "model": model,
                "cells' transport": transport,
                "classic train s": t_classic,
                "cells train s": t_cells,
                "ratio": t_cells / t_classic,
                "cells quorum s": median(cells, "train/time/quorum"),
                "cells fwd/bwd s": median(cells, "train/time/forward_backward"),
                "cells allreduce+vote s": median(cells, "train/time/reduce_and_vote"),
                "classic fwd/bwd s": median(classic, "train/time/forward_backward"),
                "classic allreduce s": median(classic, "train/time/reduce_and_vote"),
                "tokens/step": median(cells, "train/num_tokens"),
                "same losses": all(abs(a["loss"] - b["loss"]) <= 1e-6 * max(1.0, abs(a["loss"]))
                                   for a, b in zip(classic, cells)),
            }
            if args.gpu:  # bf16, and another summation order: equal up to rounding, not bitwise
                row["max loss diff"] = max(abs(a["loss"] - b["loss"]) for a, b in zip(classic, cells))
            results.append(list(row.values()))
            out[f"{model} {transport}"] = row
    print(table(list(next(iter(out.values()))), results))
    (OUT / ("cells_vs_classic_gpu.json" if args.gpu else "cells_vs_classic.json")).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
