"""Generation throughput of the rollout engines on CPU: ``local`` (HF + KV cache) vs ``vllm`` vs ``sglang`` (a real
SGLang server from ``make setup-sglang``'s environment, launched by the engine as ``make run ARGS=rollout=sglang``
does), same prompts.

    .venv/bin/python bench/bench_rollout.py [--batches 8 64] [--max-new-tokens 48] [--repeats 3] \
        [--backends local,vllm,sglang] [--sglang-python .sglang/bin/python]

One engine actor of each backend (the local engine and vLLM with 1 torch thread each, as in a run; the SGLang server
is a process of its own with SGLang's own thread settings), the tiny model with the same random weights, copy-task
prompts; each batch is one ``generate`` call of that many samples. Output tokens per second are the
generated tokens over the call's wall time (median of ``--repeats`` calls, after one warm-up call); the engines'
start-up (vLLM: building the LLM from the first weights) is reported apart. Results: outputs/bench/rollout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ray
from hydra import compose, initialize_config_dir
from runner import OUT, ROOT, table

sys.path.insert(0, str(ROOT / "tests" / "rollout"))
from engine_helpers import random_hf_state, shape_of  # the tests' tiny-policy helpers

from rlfw.cluster.ray_cluster import start_ray
from rlfw.config import register_configs
from rlfw.rollout.engines import build_engine
from rlfw.rollout.tasks import CopyTask
from rlfw.rollout.types import SamplingParams


def measure(engine, prompts, max_new_tokens: int, repeats: int) -> tuple[float, int]:
    """Median seconds of one call and the tokens it generated."""
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    ray.get(engine.generate.remote(prompts, params))  # warm-up
    seconds, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        generations = ray.get(engine.generate.remote(prompts, params))
        seconds.append(time.perf_counter() - t0)
        tokens = sum(len(g.response_ids) for g in generations)
    return statistics.median(seconds), tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="local,vllm,sglang")
    parser.add_argument("--sglang-python", default=str(ROOT / ".sglang" / "bin" / "python"))
    args = parser.parse_args()
    sglang_cpu = ["rollout.sglang.gpus_per_engine=0",
                  f"rollout.sglang.launch_command=[env,'SGLANG_USE_CPU_ENGINE=1',{args.sglang_python},-m,"
                  "sglang.launch_server]",
                  "rollout.sglang.extra_args=[--device,cpu,--attention-backend,torch_native,--disable-cuda-graph,"
                  "--skip-server-warmup,--dtype,float32,--max-total-tokens,4096,--mem-fraction-static,0.05,--sleep-on-idle]"]

    register_configs()
    run_dir = tempfile.mkdtemp(prefix="bench_rollout_")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"run_dir={run_dir}", "task.length=8", "model.max_seq_len=64",
                                                       "rollout.cpus_per_engine=1"])
        sglang = compose(config_name="config", overrides=[f"run_dir={run_dir}", "task.length=8",
                                                          "model.max_seq_len=64", "rollout.cpus_per_engine=1",
                                                          "rollout=sglang", *sglang_cpu]).rollout.sglang
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    start_ray(cfg.cluster)
    shape, task = shape_of(cfg), CopyTask(length=8)
    weights = random_hf_state(shape, scale=0.1)
    rows, results = [], {}
    try:
        for backend in args.backends.split(","):
            cfg.rollout.backend = backend
            cfg.rollout.sglang = sglang
            engine = build_engine(cfg, shape, task.tokenizer, index=0)
            t0 = time.perf_counter()
            ray.get(engine.update_weights.remote(weights, 0))
            startup = time.perf_counter() - t0
            results[backend] = {"startup_s": startup}
            for batch in args.batches:
                prompts = [p.token_ids for p in task.sample_prompts(batch, 0, np.random.default_rng(batch))]
                seconds, tokens = measure(engine, prompts, args.max_new_tokens, args.repeats)
                rows.append([backend, batch, tokens, seconds, tokens / seconds, startup])
                results[backend][batch] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
            ray.get(engine.shutdown.remote())
            ray.kill(engine)
    finally:
        ray.shutdown()
    print(table(["backend", "batch", "output tokens", "seconds (median)", "tokens/s", "first weights s"], rows))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rollout.json").write_text(json.dumps(results, indent=1))
    print(f"written: {Path(OUT / 'rollout.json')}")


if __name__ == "__main__":
    main()
