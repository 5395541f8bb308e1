"""One cell's training step on the CPU, alone: Megatron's forward/backward and Adam step over the default job's
share (128 samples of the copy task, 5 prompt + 4 response tokens), at several micro-batch token budgets
(``algo.max_tokens_per_microbatch``) and core attentions (Megatron's unfused one with the rows' T x T mask; SDPA
per packed sequence, ``loop``, or over the sequences as one padded batch, ``auto``), beside transformers'
LlamaForCausalLM on the same tokens as one padded batch (what TRL runs). One thread, one process, the variants
interleaved over the repeats; the median of each.

    .venv/bin/python bench/bench_cpu_step.py [--repeats 20] [--budgets 256 512] \
        [--attention megatron sdpa:loop sdpa:auto]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from runner import table

SAMPLES, PROMPT, RESPONSE = 128, 5, 4


def batch_for(shape, seed: int = 0):
    from rlfw.data.batch import RolloutBatch

    rng = random.Random(seed)
    cols = {"sample_id": list(range(SAMPLES)),
            "tokens": [[rng.randrange(4, 12) for _ in range(PROMPT + RESPONSE)] for _ in range(SAMPLES)],
            "prompt_len": [PROMPT] * SAMPLES, "advantage": [rng.gauss(0.0, 1.0) for _ in range(SAMPLES)]}
    return RolloutBatch(cols, {"step": 0})


def megatron_step(trainer, batch) -> float:
    t0 = time.perf_counter()
    trainer.zero_grad()
    trainer.forward_backward(batch)
    trainer.optimizer_step()
    return time.perf_counter() - t0


def hf_step(model, optimizer, tokens: torch.Tensor, advantages: torch.Tensor) -> float:
    t0 = time.perf_counter()
    optimizer.zero_grad()
    logits = model(tokens).logits[:, PROMPT - 1:-1].float()
    logprobs = logits.log_softmax(-1).gather(-1, tokens[:, PROMPT:, None]).squeeze(-1)
    loss = -(torch.exp(logprobs - logprobs.detach()) * advantages[:, None]).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--attention", nargs="+", default=["megatron", "sdpa:loop", "sdpa:auto"],
                        help="core attention (megatron, sdpa) and, for sdpa, the packed path (loop, auto)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    from rlfw.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    from megatron.core import parallel_state, tensor_parallel
    from transformers import LlamaForCausalLM

    from rlfw.cluster.store import serve_store
    from rlfw.config.schema import AlgoConfig
    from rlfw.megatron.policy import PolicyTrainer
    from rlfw.model.hf_convert import hf_config
    from rlfw.model.shape import ModelShape

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=serve_store("127.0.0.1"), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)
    shape = ModelShape(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                       vocab_size=16, max_seq_len=64)  # model=tiny on the copy task
    from rlfw.megatron import attention

    trainers, batch = {}, None
    for core in args.attention:
        for budget in args.budgets:
            trainers[core, budget] = PolicyTrainer(
                shape, AlgoConfig(name="grpo", max_tokens_per_microbatch=budget), tp=1, temperature=1.0,
                device=torch.device("cpu"), init_seed=0, core_attention=core.partition(":")[0])
            if batch is None:
                whole = batch_for(shape)
                whole.samples.update(trainers[core, budget].logprobs(whole))
                (batch,) = whole.minibatches(0)
    model = LlamaForCausalLM(hf_config(shape)).float()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    tokens = torch.tensor(batch.samples["tokens"])
    advantages = torch.tensor(batch.samples["advantage"])
    times = {name: [] for name in [*(f"megatron, {c} attention, budget {b}" for c, b in trainers),
                                   "transformers, one batch"]}
    for _ in range(args.repeats):
        for (core, budget), trainer in trainers.items():
            attention.PACKED_IMPL = core.partition(":")[2] or "auto"
            times[f"megatron, {core} attention, budget {budget}"].append(megatron_step(trainer, batch))
        times["transformers, one batch"].append(hf_step(model, optimizer, tokens, advantages))
    rows = [[name, statistics.median(v[2:]) * 1000, min(v[2:]) * 1000] for name, v in times.items()]
    print(table(["step of 128 samples x 9 tokens, 1 thread", "median ms", "min ms"], rows))
    print(f"load average while it ran (others' work on this machine counts): {os.getloadavg()}")


if __name__ == "__main__":
    main()
