"""RL on one GPU, end to end: ``python -m rlfw.train`` runs of a Qwen2-0.5B- or 1.5B-shaped policy (``--shape``;
random init, the real vocabulary's output layer) on the long-tailed copy task, one row per placement and loop (and
one on a stock SGLang server: ``sglang_colocated_2cells``), with the GPU's memory sampled meanwhile. Prints one table; each run's
metrics.jsonl and the memory trace go to ``--out``.

    python3 bench/bench_gpu_rl.py --out $OUT [--rows colocated_2cells_kill,separate_sync,separate_async] [--steps 8]
        [--shape 0.5b]

Per row, over the steps after the first (warm-up): the step's seconds in generation (``time/generate``), the
trainer's log-probs pass (``time/logprobs``, 0 when the training forward computes them), training
(``time/train``), the weight push as the manager saw it (``time/weight_sync``, overlapping the driver's next
step), and the rest of the step (driver: logging, checkpointing, waits); generated tokens per second of generation,
trained samples per second of wall time, the trainers' peak allocated GPU memory inside a train call
(``gpu/train_peak_gib``) and the engine's inside a generate call (``rollout/engine_gpu_peak_gib``), the handover's
seconds, and the GPU's memory in use (nvidia-smi, whole card) at its
highest while the engine generated and while the trainers trained.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

from runner import OUT, run_training, table

QWEN2 = ["model.num_query_groups=2", "model.vocab_size=151936", "model.qkv_bias=true",
         "model.tie_word_embeddings=true", "model.rope_theta=1000000", "model.norm_epsilon=1e-6",
         "model.max_seq_len=160"]
SHAPES = {
    "0.5b": ["model.num_layers=24", "model.hidden_size=896", "model.num_attention_heads=14",
             "model.ffn_hidden_size=4864", *QWEN2],
    "1.5b": ["model.num_layers=28", "model.hidden_size=1536", "model.num_attention_heads=12",
             "model.ffn_hidden_size=8960", *QWEN2],
}
COMMON = ["cluster.device=cuda", "task.length=64", "+task.min_length=2", "rollout.num_prompts=64",
          "rollout.n_samples_per_prompt=8", "algo.max_tokens_per_microbatch=16384", "algo.lr=1e-4",
          "logger=jsonl", "checkpoint.save_final=false", "ft.verify_weights_every=5"]
# rollout=sglang: a stock SGLang server (bench/carry/build_sglang.sh, unpacked into /tmp/sglang-site by its
# install_sglang.sh) on the GPU, its PYTHONPATH that folder alone; triton attention and torch sampling, no FlashInfer.
# --mem-fraction-static 0.25: with 0.5 the server and two colocated cells did not fit an H100
SGLANG = ["rollout=sglang",
          "rollout.sglang.launch_command=[env,'PYTHONPATH=/tmp/sglang-site','{python}',-m,sglang.launch_server]",
          "rollout.sglang.extra_args=[--attention-backend,triton,--sampling-backend,pytorch,--dtype,bfloat16,"
          "--mem-fraction-static,0.25]", "rollout.sglang.startup_timeout_s=300"]
ROWS = {
    # two one-rank cells on the GPU with the engine, memory handed over; cell 1 SIGKILLed inside step 3's backward
    "colocated_2cells_kill": ["dp=cells", "dp.num_cells=2", "cluster.gpus_per_worker=0.5",
                              "cluster.placement=colocated", "loop=sync", "fault=kill_once", "fault.cell=1",
                              "fault.step=3", "fault.phase=mid_forward_backward", "ft.await_replacement_s=120"],
    # the same two cells beside an SGLang server, which keeps its quarter of the GPU through training; micro-batches
    # of 4096 tokens: at 16384 each cell's training peak (27.8 GiB) beside the server's did not fit an H100 (cells died)
    "sglang_colocated_2cells": [*SGLANG, "dp=cells", "dp.num_cells=2", "cluster.gpus_per_worker=0.5",
                                "cluster.placement=colocated", "loop=sync", "algo.max_tokens_per_microbatch=4096"],
    "colocated_classic": ["dp=classic", "dp.size=1", "cluster.placement=colocated", "loop=sync"],
    # one cell and the engine each with half the GPU in Ray's books, both resident
    "separate_sync": ["dp=cells", "dp.num_cells=1", "cluster.gpus_per_worker=0.5", "rollout.gpus_per_engine=0.5",
                      "loop=sync"],
    # the same with the weights through host memory and Ray (the other rows share them on the GPU: auto)
    "separate_sync_host": ["dp=cells", "dp.num_cells=1", "cluster.gpus_per_worker=0.5", "rollout.gpus_per_engine=0.5",
                           "loop=sync", "rollout.weight_transport=host"],
    "separate_async": ["dp=cells", "dp.num_cells=1", "cluster.gpus_per_worker=0.5", "rollout.gpus_per_engine=0.5",
                       "loop=async", "loop.max_staleness=1"],
}


class MemoryTrace(threading.Thread):
    """The GPU's memory in use, every ``period_s``, from nvidia-smi: (time.time(), MiB)."""

    def __init__(self, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.period_s, self.samples, self._done = period_s, [], threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            if out:
                self.samples.append((time.time(), float(out[0])))
            self._done.wait(self.period_s)

    def stop(self) -> list:
        self._done.set()
        self.join(15)
        return self.samples


def summarise(name: str, result: dict, trace: list) -> dict:
    rows = [r for r in result["rows"] if "time/step" in r]
    steady = rows[1:] or rows

    def mean(key: str) -> float:
        values = [r.get(key, 0.0) for r in steady]
        return statistics.mean(values) if values else 0.0

    tokens = [r["rollout/response_len"] * r["rollout/num_samples"] / r["time/generate"] for r in steady]
    phases = mean("time/generate") + mean("time/logprobs") + mean("time/train")
    out = {"row": name, "steps": len(rows), "generate_s": mean("time/generate"), "logprobs_s": mean("time/logprobs"),
           "train_s": mean("time/train"), "push_s": mean("time/weight_sync"), "step_s": mean("time/step"),
           "driver_s": mean("time/step") - phases, "gen_tok_s": statistics.mean(tokens),
           "samples_s": mean("train/num_samples") / max(mean("time/step"), 1e-9),
           "train_peak_gib": max((r.get("train/gpu/train_peak_gib", 0.0) for r in rows), default=0.0),
           "engine_peak_gib": max((r.get("rollout/engine_gpu_peak_gib", 0.0) for r in rows), default=0.0),
           "restore_s": mean("train/time/state_restore"), "release_s": mean("train/time/state_release"),
           "released_gib": mean("train/offload/released_gib"), "response_len": mean("rollout/response_len"),
           "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
           "card_peak_gib": max((m for _, m in trace), default=0.0) / 1024,
           "step_times": [round(r["time/step"], 3) for r in rows], "rewards": [r["reward/mean"] for r in rows],
           "events": [e.get("kind") for e in result["events"]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="colocated_2cells_kill,separate_sync,separate_async")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="Qwen2 shape (random weights)")
    parser.add_argument("--out", default=str(OUT / "gpu_rl"))
    parser.add_argument("--deadline-s", type=float, default=520, help="start no row after this many seconds")
    parser.add_argument("extra", nargs="*", help="more overrides for every row")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results = []
    for name in args.rows.split(","):
        if time.time() - started > args.deadline_s:
            print(f"{name}: not started (deadline)", flush=True)
            continue
        steps = args.steps * 3 if name == "colocated_2cells_kill" else args.steps  # its reward curve
        trace = MemoryTrace()
        trace.start()
        try:
            result = run_training(f"gpu_rl_{name}", [*COMMON, *SHAPES[args.shape], *ROWS[name], f"num_steps={steps}",
                                                     *args.extra],
                                  timeout_s=max(60, 590 - (time.time() - started)))
        except Exception as e:  # noqa: BLE001  (the next row still runs; the error is in the output)
            print(f"{name}: FAILED {e}"[:4000], flush=True)
            trace.stop()
            continue
        samples = trace.stop()
        summary = summarise(name, result, samples)
        results.append(summary)
        print(json.dumps(summary), flush=True)
        shutil.copy(result["run_dir"] / "metrics.jsonl", out / f"{name}.metrics.jsonl")
        (out / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    keys = ["row", "steps", "generate_s", "logprobs_s", "train_s", "push_s", "driver_s", "step_s", "gen_tok_s",
            "samples_s", "train_peak_gib", "engine_peak_gib", "card_peak_gib", "restore_s", "release_s"]
    print(table(keys, [[r[k] for k in keys] for r in results]), flush=True)


if __name__ == "__main__":
    main()
