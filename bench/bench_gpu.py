"""GPU benchmark of rlfw's Megatron trainer: one call on one GPU measures the matmul ceiling, checks the attention
paths against an fp32 reference, and times whole GRPO train steps through ``PolicyTrainer``.

Model: Qwen2-1.5B-shaped, random weights (28 layers, hidden 1536, 12 heads, 2 query groups, ffn 8960, vocab 151936,
untied output layer), bf16 weights with fp32 main grads and fp32 master weights / Adam state (Megatron's
mixed-precision optimizer), micro-batches of at most 4096 tokens, world size 1 (NCCL, Megatron parallel_state).

Measured:
  (a) the bf16 matmul rate: 8192^3 ``torch.matmul`` on random data, median of CUDA-event-timed repeats;
  (b) whole train steps through ``PolicyTrainer`` (zero_grad, forward_backward with rlfw's packing and GRPO loss,
      Megatron DDP's grad reduction ``finish_grad_sync``, ``optimizer_step`` with its finite check, clipping and
      Adam), Megatron's unfused attention (``core_attention="megatron"``) against ``SDPAttention`` (``"sdpa"``), on
      packed rows (several sequences per row, block-diagonal causal mask) and on rows holding one 4096-token
      sequence; plus the packed-row variants of SDPAttention (varlen flash, one SDPA call per sequence, one SDPA
      call with the explicit mask) and a variant with Megatron's torch.compile'd SwiGLU / bias-dropout-add fusions;
  (c) bare Megatron forward/backward on the same model: ``get_forward_backward_func`` with Megatron's own LM loss
      (``labels=``), causal attention without a mask, no rlfw packing or loss: rlfw's overhead is the difference.

FLOPs (per step, fwd + bwd = 3 x fwd):
    model_flops = 6 * N * tokens + 12 * L * (heads * head_dim) * sum_i(n_i ** 2)
where N = matmul weights = L * (h*(h + 2*g*d) + h*h + 3*h*ffn) + h*V (no input embedding, no norms), tokens =
sum_i n_i over the step's sequences of lengths n_i. The attention term is the usual 12 * L * h * seq per token
with seq = the token's own sequence length (packing does not add attention work); it counts the full score matrix
(PaLM / Megatron convention). ``MFU_causal`` halves the attention term (the work a causal kernel does).
MFU = model_flops / step_time / rate, against the measured matmul rate of (a) (column ``%mm``) and against the
H100/H200 SXM datasheet's 989 TFLOP/s dense bf16 (column ``%989``).

Diagnostics: ``diag`` splits rlfw's forward_backward into CPU packing, host-to-device copies and the rest, reruns it
with the micro-batches prebuilt on the device, and reads the device-busy time from torch.profiler; ``--budgets
4096,8192,16384`` repacks the same sequences under larger token budgets per micro-batch (rows prebuilt on the
device). ``--skip`` takes any of check,gqa,megatron,sdpa,variants,diag,profile,fused.

Usage (GPU; the megatron-core wheel is carried as .whl):
    PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py --out $OUT
Dry run on CPU (tiny model, fp32, gloo): python bench/bench_gpu.py --cpu-dry-run
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(key, value)  # NVLink multicast stays off (the lending workplace's rule)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch  # noqa: E402
from rlfw.megatron.model import ModelShape  # noqa: E402

QWEN2_1P5B = ModelShape(
    num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2, ffn_hidden_size=8960,
    vocab_size=151936, max_seq_len=4096, rope_theta=1e6, norm_epsilon=1e-6,
)
TINY = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, vocab_size=512,
    max_seq_len=256,
)
DATASHEET_BF16 = 989e12

RESULTS = []
OUT_DIR = None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record(**row) -> None:
    RESULTS.append(row)
    if OUT_DIR is not None:
        with open(OUT_DIR / "bench_gpu.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------------ FLOPs
def matmul_weights(shape: ModelShape) -> int:
    h, d, g, f = shape.hidden_size, shape.head_dim, shape.num_query_groups, shape.ffn_hidden_size
    per_layer = h * (h + 2 * g * d) + h * h + 3 * h * f
    return shape.num_layers * per_layer + h * shape.vocab_size


def model_flops(shape: ModelShape, lengths) -> tuple[float, float]:
    """(full, causal) fwd+bwd FLOPs of one step over sequences of ``lengths``."""
    dense = 6.0 * matmul_weights(shape) * sum(lengths)
    attn = 12.0 * shape.num_layers * shape.num_attention_heads * shape.head_dim * sum(n * n for n in lengths)
    return dense + attn, dense + attn / 2


# ---------------------------------------------------------------------------------------------------- matmul
def matmul_rate(n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * n ** 3 / statistics.median(times)


# ------------------------------------------------------------------------------------------------------ data
def packed_lengths(rng: random.Random, rows: int, budget: int, lo: int, hi: int):
    """Sequence lengths that fill ``rows`` rows of ``budget`` tokens exactly (uniform in [lo, hi], the last of each
    row takes what is left, at least 16)."""
    lengths = []
    for _ in range(rows):
        left = budget
        while left > hi + lo:
            n = rng.randint(lo, hi)
            lengths.append(n)
            left -= n
        if left > hi:
            lengths += [left // 2, left - left // 2]
        else:
            lengths.append(left)
    rng.shuffle(lengths)
    return lengths


def rollout_batch(shape: ModelShape, lengths, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    cols = {k: [] for k in ("sample_id", "group_id", "tokens", "prompt_len", "advantage", "old_logprobs")}
    for i, n in enumerate(lengths):
        p = max(1, min(n - 1, n // 4))
        cols["sample_id"].append(i)
        cols["group_id"].append(i // 8)
        cols["tokens"].append([rng.randrange(shape.vocab_size) for _ in range(n)])
        cols["prompt_len"].append(p)
        cols["advantage"].append(rng.gauss(0.0, 1.0))
        # near a random model's log-prob (-log V): PPO ratios start near 1
        cols["old_logprobs"].append([-math.log(shape.vocab_size) + rng.gauss(0.0, 0.1) for _ in range(n - p)])
    batch = RolloutBatch(cols, {"step": 0})
    batch.meta[DYNAMIC_GBS] = {"num_samples": len(batch), "num_tokens": batch.num_response_tokens()}
    return batch


# ----------------------------------------------------------------------------------------------------- world
def init_world(device) -> None:
    from megatron.core import parallel_state

    from rlfw.cluster.store import serve_store

    if device.type == "cpu":
        from rlfw.megatron.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    else:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=serve_store("127.0.0.1"), rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def algo_config(max_tokens: int):
    return SimpleNamespace(
        lr=1e-6, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, grad_clip=1.0, clip_eps_low=0.2,
        clip_eps_high=0.28, kl_coef=0.0, loss_agg="token_mean", max_tokens_per_microbatch=max_tokens,
    )


def build_trainer(shape, attention: str, device, bf16: bool, max_tokens: int, config_overrides=None):
    """A PolicyTrainer whose model uses ``attention``; ``config_overrides`` are set on its TransformerConfig."""
    from rlfw.megatron import model as rlfw_model
    from rlfw.megatron import policy

    original_build, original_config = policy.build_gpt, policy.transformer_config

    def config_with_overrides(*args, **kwargs):
        config = original_config(*args, **kwargs)
        for k, v in (config_overrides or {}).items():
            setattr(config, k, v)
        return config

    policy.build_gpt = functools.partial(rlfw_model.build_gpt, core_attention=attention)
    policy.transformer_config = config_with_overrides
    try:
        return policy.PolicyTrainer(shape, algo_config(max_tokens), tp=1, temperature=1.0, device=device,
                                    init_seed=0, bf16=bf16)
    finally:
        policy.build_gpt, policy.transformer_config = original_build, original_config


def free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -------------------------------------------------------------------------------------------------- timing
def train_step(trainer, batch, device) -> dict:
    sync(device)
    t0 = time.perf_counter()
    trainer.zero_grad()
    sums = trainer.forward_backward(batch)
    sync(device)
    t1 = time.perf_counter()
    trainer.model.finish_grad_sync()
    sync(device)
    t2 = time.perf_counter()
    grad_norm = trainer.optimizer_step()
    sync(device)
    t3 = time.perf_counter()
    return {"step_s": t3 - t0, "fwd_bwd_s": t1 - t0, "reduce_s": t2 - t1, "optim_s": t3 - t2,
            "grad_norm": grad_norm, "loss": sums.get("loss")}


def fwd_bwd_only(trainer, batch, device) -> dict:
    sync(device)
    t0 = time.perf_counter()
    trainer.zero_grad()
    trainer.forward_backward(batch)
    sync(device)
    return {"fwd_bwd_s": time.perf_counter() - t0}


def bare_megatron(trainer, shape, rows: int, seq: int, device, attention: str) -> dict:
    """Megatron's schedule and LM loss on ``rows`` rows of one ``seq``-token sequence each (no rlfw code)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    g = torch.Generator(device="cpu").manual_seed(1)
    data = []
    for _ in range(rows):
        tokens = torch.randint(0, shape.vocab_size, (1, seq), generator=g)
        data.append((tokens.to(device), torch.arange(seq).unsqueeze(0).to(device), tokens.roll(-1, 1).to(device)))
    # Megatron's own causal mask needs CUDA; on the CPU dry run its attention gets the explicit mask.
    mask = None
    if device.type == "cpu" and attention == "megatron":
        mask = ~torch.ones(seq, seq, dtype=torch.bool).tril().view(1, 1, seq, seq)

    def forward_step(data_iterator, model):
        tokens, positions, labels = next(data_iterator)
        loss = model(tokens, positions, mask, labels=labels)  # [1, seq], fp32

        def loss_func(output):
            total = output.sum()
            return total, torch.tensor(seq, dtype=torch.int, device=device), {"loss": total.detach()}

        return loss, loss_func

    def run():
        trainer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(data), model=[trainer.model], num_microbatches=rows,
            seq_length=seq, micro_batch_size=1, forward_only=False,
        )

    run()  # warm-up
    times = []
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"fwd_bwd_s": statistics.median(times)}


def profile_step(trainer, batch, device) -> None:
    """One train step under torch.profiler: the kernels that take the device's time, to $OUT/profile.txt."""
    from torch.profiler import ProfilerActivity, profile

    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            train_step(trainer, batch, device)
        averages = prof.key_averages()
        text = None
        for key in ("self_cuda_time_total", "self_device_time_total", "self_cpu_time_total"):
            try:
                text = averages.table(sort_by=key, row_limit=30, max_name_column_width=70)
                break
            except Exception:  # noqa: BLE001  (the sort key's name changed across torch versions)
                continue
        if OUT_DIR is not None and text:
            (OUT_DIR / "profile.txt").write_text(text)
        print(text[:3000] if text else "no profile table", flush=True)
    except Exception as exc:  # noqa: BLE001
        log(f"profile FAILED: {exc!r}")


def device_busy_s(fn, table_to: str | None = None) -> tuple[float, float]:
    """(wall seconds, seconds the device spent in kernels and copies) of ``fn()`` under torch.profiler."""
    import re

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(torch.device("cuda" if cuda else "cpu"))
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        sync(torch.device("cuda" if cuda else "cpu"))
        wall = time.perf_counter() - t0
    text = prof.key_averages().table(row_limit=1)
    if table_to and OUT_DIR is not None and cuda:
        (OUT_DIR / table_to).write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40,
                                                                  max_name_column_width=70))
    match = re.search(r"Self (?:CUDA|device) time total: ([\d.]+)(us|ms|s)", text)
    if not match:
        return wall, float("nan")
    return wall, float(match.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match.group(2)]


def diagnose(trainer, shape, batches, lengths_of, rows, seq, device, rate) -> None:
    """Where rlfw's forward_backward spends the time that bare Megatron does not: CPU packing, host-to-device
    copies, the T x T masks, and the GPU's idle time (wall - device-busy)."""
    from rlfw.megatron import policy
    from rlfw.megatron.packing import MicroBatch

    original_microbatches, original_to = policy.microbatches, MicroBatch.to
    phases = {"pack_s": 0.0, "h2d_s": 0.0}

    def timed_microbatches(*a, **k):
        t0 = time.perf_counter()
        out = original_microbatches(*a, **k)
        phases["pack_s"] += time.perf_counter() - t0
        return out

    def timed_to(self, dev):
        sync(device)
        t0 = time.perf_counter()
        out = original_to(self, dev)
        sync(device)
        phases["h2d_s"] += time.perf_counter() - t0
        return out

    def prebuilt(data, drop_mask=False):
        built = [(i, original_to(mb, device)) for i, mb in original_microbatches(
            batches[data], seq, trainer.algo.loss_agg)]
        if drop_mask:
            for _, mb in built:
                mb.attention_mask = None
        return lambda *a, **k: built

    try:
        for data in ("single", "packed"):
            policy.microbatches, MicroBatch.to = timed_microbatches, timed_to
            fwd_bwd_only(trainer, batches[data], device)
            timings = []
            for _ in range(2):
                phases.update(pack_s=0.0, h2d_s=0.0)
                timings.append({**fwd_bwd_only(trainer, batches[data], device), **phases})
            summarise(f"diag rlfw fwd+bwd {data} (timed phases)", shape, lengths_of[data], timings, rate,
                      {"what": "diag"})
            policy.microbatches, MicroBatch.to = original_microbatches, original_to
            variants = [("prebuilt on device", False)] + ([("prebuilt, mask None", True)] if data == "single" else [])
            for label, drop in variants:
                policy.microbatches = prebuilt(data, drop)
                fwd_bwd_only(trainer, batches[data], device)
                timings = [fwd_bwd_only(trainer, batches[data], device) for _ in range(2)]
                wall, busy = device_busy_s(lambda: fwd_bwd_only(trainer, batches[data], device))
                summarise(f"diag rlfw fwd+bwd {data} ({label})", shape, lengths_of[data], timings, rate,
                          {"what": "diag", "profiled_wall_s": wall, "device_busy_s": busy})
                policy.microbatches = original_microbatches
        wall, busy = device_busy_s(lambda: train_step(trainer, batches["packed"], device), "profile_step_packed.txt")
        record(kind="diag", name="rlfw step packed under profiler", wall_s=wall, device_busy_s=busy)
        for r in RESULTS[-8:]:
            log(f"diag: {r}")
    except Exception as exc:  # noqa: BLE001
        log(f"diagnose FAILED: {exc!r}")
        traceback.print_exc()
    finally:
        policy.microbatches, MicroBatch.to = original_microbatches, original_to


def token_budgets(trainer, shape, batch, lengths, device, rate, budgets, repeats) -> None:
    """Whole steps on the same sequences packed under larger token budgets per micro-batch (fewer, longer rows:
    less host work per token), with the rows prebuilt on the device so that rlfw's CPU-side T x T masks (quadratic
    in the budget) stay out of the timing."""
    from rlfw.megatron import policy
    from rlfw.megatron.packing import microbatches

    original = policy.microbatches
    for budget in budgets:
        name = f"sdpa step packed, budget {budget} (prebuilt)"
        try:
            t0 = time.perf_counter()
            built = [(i, mb.to(device)) for i, mb in microbatches(batch, budget, trainer.algo.loss_agg)]
            pack_s = time.perf_counter() - t0
            policy.microbatches = lambda *a, _built=built, **k: _built
            train_step(trainer, batch, device)
            timings = [train_step(trainer, batch, device) for _ in range(repeats)]
            summarise(name, shape, lengths, timings, rate, {"what": "budget", "budget": budget, "rows": len(built),
                                                            "cpu_pack_and_copy_s": pack_s})
        except Exception as exc:  # noqa: BLE001
            record(kind="timing", name=name, error=repr(exc))
            log(f"{name} FAILED: {exc!r}")
        finally:
            policy.microbatches = original
            built = None
            gc.collect()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


def summarise(name, shape, lengths, timings, rate, extra=None):
    full, causal = model_flops(shape, lengths)
    tokens = sum(lengths)
    med = {k: statistics.median([t[k] for t in timings]) for k in timings[0] if k.endswith("_s")}
    main = med.get("step_s", med.get("fwd_bwd_s"))
    row = {"name": name, "tokens": tokens, "num_seqs": len(lengths), "repeats": len(timings), **med,
           "tokens_per_s": tokens / main, "model_tflops": full / main / 1e12,
           "mfu_mm": full / main / rate if rate else None, "mfu_989": full / main / DATASHEET_BF16,
           "mfu_causal_mm": causal / main / rate if rate else None,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    for k in ("grad_norm", "loss"):
        if k in timings[-1]:
            row[k] = timings[-1][k]
    row.update(extra or {})
    record(kind="timing", **row)
    log(f"{name}: {main * 1e3:.1f} ms, {row['tokens_per_s']:.0f} tok/s, {row['model_tflops']:.1f} TFLOP/s"
        + (f", MFU {100 * row['mfu_mm']:.1f}% of measured matmul" if rate else ""))
    return row


# ---------------------------------------------------------------------------------------------- correctness
def check_attention(shape, device) -> None:
    """Logits and grads of bf16 models (Megatron attention; SDPA packed-row paths) against an fp32 Megatron
    reference with the same weights, on one packed row: ||x - ref|| / ||ref||."""
    from megatron.core import tensor_parallel

    from rlfw.megatron import attention as sdpa_module
    from rlfw.megatron.model import build_gpt, transformer_config

    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=device.type == "cpu")
    small = ModelShape(**{**shape.__dict__, "num_layers": 2, "vocab_size": min(shape.vocab_size, 32000)})
    lengths = [1000, 37, 2048, 1011] if shape.max_seq_len >= 4096 else [50, 3, 100, 40]
    T = sum(lengths)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, small.vocab_size, (1, T), generator=g).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (~(torch.ones(T, T, dtype=torch.bool).tril() & (seq_id[:, None] == seq_id[None, :]))).view(1, 1, T, T)
    mask = mask.to(device)

    def run(attention, bf16):
        torch.manual_seed(0)
        model = build_gpt(small, transformer_config(small, bf16=bf16), core_attention=attention).to(device)
        if state is not None:
            model.load_state_dict(state)
        logits = model(tokens, positions, mask)
        (logits.float().pow(2).mean()).backward()
        grad = model.decoder.layers[0].self_attention.linear_qkv.weight.grad.float()
        return model, logits.detach().float(), grad

    state = None
    ref_model, ref, ref_grad = run("megatron", False)
    state = ref_model.state_dict()  # (some entries are None: Megatron's extra state)
    bf16 = device.type == "cuda"
    cases = [("megatron", "auto", bf16, "megatron bf16" if bf16 else "megatron fp32")]
    for impl in ("auto", "varlen", "loop", "mask"):
        if impl == "varlen" and not (bf16 and sdpa_module.varlen_usable(tokens.new_empty(0, dtype=torch.bfloat16),
                                                                        0.0)):
            continue
        cases.append(("sdpa", impl, bf16, f"sdpa[{impl}] {'bf16' if bf16 else 'fp32'}"))
    cases.append(("sdpa", "auto", False, "sdpa[auto] fp32"))
    for attention, impl, half, label in cases:
        sdpa_module.PACKED_IMPL = impl
        try:
            model, out, grad = run(attention, half)
            err = ((out - ref).norm() / ref.norm()).item()
            gerr = ((grad - ref_grad).norm() / ref_grad.norm()).item()
            record(kind="check", name=label, logits_rel_err=err, qkv_grad_rel_err=gerr)
            log(f"check {label}: logits rel err {err:.2e}, layer-0 qkv grad rel err {gerr:.2e}")
            del model
        except Exception as exc:  # noqa: BLE001
            record(kind="check", name=label, error=repr(exc))
            log(f"check {label} FAILED: {exc!r}")
            traceback.print_exc()
        finally:
            sdpa_module.PACKED_IMPL = "auto"
    free()


def varlen_gqa_check(device) -> bool:
    """Grouped K/V straight into torch's varlen flash kernel vs K/V repeated to all heads: same outputs and grads?
    Also times both (fwd + bwd, 28 calls = one model's layers)."""
    from rlfw.megatron import attention as sdpa_module

    if not sdpa_module.varlen_usable(torch.empty(0, device=device, dtype=torch.bfloat16), 0.0):
        return False
    lengths = [1000, 37, 2048, 1011]
    cu, longest = sdpa_module.segments_to_cu_seqlens(lengths, device)
    T, scale = sum(lengths), 1.0 / math.sqrt(128)
    g = torch.Generator(device=device).manual_seed(0)
    q0 = torch.randn(T, 12, 128, device=device, dtype=torch.bfloat16, generator=g)
    k0, v0 = (torch.randn(T, 2, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn(T, 12, 128, device=device, dtype=torch.bfloat16, generator=g)

    def run(mode):
        sdpa_module.VARLEN_GQA = mode
        q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
        out = sdpa_module._run_varlen(q, k, v, cu, cu, longest, longest, True, scale)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    ok, previous = False, sdpa_module.VARLEN_GQA
    try:
        ref = run("repeat")
        got = run("native")
        errs = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]
        ok = max(errs) < 1e-2
        timings = {}
        for mode in ("repeat", "native"):
            for _ in range(3):
                run(mode)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(28):
                run(mode)
            torch.cuda.synchronize()
            timings[mode] = (time.perf_counter() - t0) / 28
        record(kind="check", name="varlen native GQA vs repeat", rel_err_out_dq_dk_dv=errs, ok=ok,
               fwd_bwd_ms={k: v * 1e3 for k, v in timings.items()})
        log(f"varlen GQA native vs repeat: rel errs {errs}, per-layer fwd+bwd ms {timings}")
    except Exception as exc:  # noqa: BLE001
        record(kind="check", name="varlen native GQA vs repeat", error=repr(exc))
        log(f"varlen native GQA FAILED: {exc!r}")
    finally:
        sdpa_module.VARLEN_GQA = previous
    return ok


# ------------------------------------------------------------------------------------------------------ main
def main() -> None:
    global OUT_DIR
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/bench/gpu"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU, to test the script")
    parser.add_argument("--rows", type=int, default=8, help="micro-batches (rows of --seq tokens) per step")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--budgets", default="", help="token budgets per micro-batch to compare (prebuilt rows)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    OUT_DIR = Path(args.out)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "bench_gpu.jsonl").unlink(missing_ok=True)

    dry = args.cpu_dry_run or not torch.cuda.is_available()
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    shape = TINY if dry else QWEN2_1P5B
    seq = min(args.seq, shape.max_seq_len)
    rows = 2 if dry else args.rows
    bf16 = not dry

    import megatron.core

    env = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "torch": torch.__version__,
           "megatron_core": megatron.core.__version__, "python": sys.version.split()[0], "device": str(device),
           "gpu": torch.cuda.get_device_name(0) if not dry else None, "shape": shape.__dict__, "seq": seq,
           "rows": rows, "matmul_weights": matmul_weights(shape)}
    try:
        from torch.nn.attention.varlen import varlen_attn
        import inspect

        env["varlen_signature"] = str(inspect.signature(varlen_attn))
    except Exception as exc:  # noqa: BLE001
        env["varlen_signature"] = repr(exc)
    record(kind="env", **env)
    log(f"env: {json.dumps(env)}")

    rate = None
    if not dry:
        rate = matmul_rate()
        record(kind="matmul", name="bf16 8192^3 matmul", tflops=rate / 1e12)
        log(f"bf16 matmul: {rate / 1e12:.1f} TFLOP/s")

    init_world(device)
    if "check" not in skip:
        check_attention(shape, device)
    native_gqa_ok = (not dry) and "gqa" not in skip and varlen_gqa_check(device)

    rng = random.Random(0)
    packed = packed_lengths(rng, rows, seq, lo=max(16, seq // 32), hi=seq // 2)
    single = [seq] * rows
    batches = {"packed": rollout_batch(shape, packed, seed=1), "single": rollout_batch(shape, single, seed=2)}
    record(kind="data", packed_lengths=packed, single_lengths=single)
    from rlfw.megatron.packing import microbatches

    for label, batch in batches.items():
        t0 = time.perf_counter()
        mbs = microbatches(batch, seq, "token_mean")
        cpu_s = time.perf_counter() - t0
        record(kind="packing", name=label, rows=len(mbs), cpu_pack_s=cpu_s)
        log(f"data {label}: {len(batch)} sequences, {sum(len(t) for t in batch.samples['tokens'])} tokens in "
            f"{len(mbs)} rows; rlfw packing on CPU {cpu_s * 1e3:.1f} ms")
        del mbs

    from rlfw.megatron import attention as sdpa_module

    def step_runs(trainer, name, data, attention):
        lengths = packed if data == "packed" else single
        try:
            train_step(trainer, batches[data], device)  # warm-up (allocates the optimizer state)
            timings = [train_step(trainer, batches[data], device) for _ in range(args.repeats)]
            summarise(name, shape, lengths, timings, rate, {"attention": attention, "data": data, "what": "step"})
        except Exception as exc:  # noqa: BLE001
            record(kind="timing", name=name, error=repr(exc))
            log(f"{name} FAILED: {exc!r}")
            traceback.print_exc()

    def fb_runs(trainer, name, data, attention, impl="auto"):
        lengths = packed if data == "packed" else single
        sdpa_module.PACKED_IMPL = impl
        try:
            fwd_bwd_only(trainer, batches[data], device)
            timings = [fwd_bwd_only(trainer, batches[data], device) for _ in range(2)]
            summarise(name, shape, lengths, timings, rate, {"attention": attention, "data": data, "what": "fwd_bwd"})
        except Exception as exc:  # noqa: BLE001
            record(kind="timing", name=name, error=repr(exc))
            log(f"{name} FAILED: {exc!r}")
            traceback.print_exc()
        finally:
            sdpa_module.PACKED_IMPL = "auto"

    def bare_runs(trainer, name, attention):
        try:
            timing = bare_megatron(trainer, shape, rows, seq, device, attention)
            summarise(name, shape, single, [timing], rate, {"attention": attention, "data": "single",
                                                            "what": "bare_fwd_bwd"})
        except Exception as exc:  # noqa: BLE001
            record(kind="timing", name=name, error=repr(exc))
            log(f"{name} FAILED: {exc!r}")
            traceback.print_exc()

    for attention in ("megatron", "sdpa"):
        if attention in skip:
            continue
        log(f"building the {attention} trainer")
        t0 = time.perf_counter()
        try:
            trainer = build_trainer(shape, attention, device, bf16, seq)
        except Exception as exc:  # noqa: BLE001
            record(kind="build", name=attention, error=repr(exc))
            log(f"build {attention} FAILED: {exc!r}")
            traceback.print_exc()
            continue
        params = list(trainer.model.module.parameters())
        record(kind="build", name=attention, build_s=time.perf_counter() - t0,
               param_dtypes=sorted({str(p.dtype) for p in params}),
               main_grad_dtypes=sorted({str(p.main_grad.dtype) for p in params if hasattr(p, "main_grad")}),
               optimizer=type(trainer.optimizer).__name__,
               inner_optimizer=type(getattr(trainer.optimizer, "optimizer", None)).__name__,
               num_params=sum(p.numel() for p in params))
        log(f"built in {time.perf_counter() - t0:.1f} s: {RESULTS[-1]}")
        step_runs(trainer, f"{attention} step packed", "packed", attention)
        step_runs(trainer, f"{attention} step single", "single", attention)
        fb_runs(trainer, f"{attention} fwd+bwd single", "single", attention)
        bare_runs(trainer, f"{attention} bare-megatron fwd+bwd single", attention)
        if attention == "sdpa" and "variants" not in skip:
            for impl in ("varlen", "loop", "mask"):
                if impl == "varlen" and not (bf16 and sdpa_module.varlen_usable(
                        torch.empty(0, device=device, dtype=torch.bfloat16), 0.0)):
                    continue
                fb_runs(trainer, f"sdpa[{impl}] fwd+bwd packed", "packed", attention, impl)
            previous = sdpa_module.VARLEN_GQA
            sdpa_module.VARLEN_GQA = "native" if previous == "repeat" else "repeat"
            if not dry and (sdpa_module.VARLEN_GQA == "repeat" or native_gqa_ok):
                fb_runs(trainer, f"sdpa[varlen, {sdpa_module.VARLEN_GQA} GQA] fwd+bwd packed", "packed", attention,
                        "varlen")
            sdpa_module.VARLEN_GQA = previous
            try:
                sync(device)
                t0 = time.perf_counter()
                trainer.logprobs(batches["packed"])
                sync(device)
                lp_s = time.perf_counter() - t0
                record(kind="timing", name="sdpa logprobs packed (fwd only)", fwd_s=lp_s,
                       tokens_per_s=sum(packed) / lp_s)
                log(f"logprobs packed: {lp_s * 1e3:.1f} ms")
            except Exception as exc:  # noqa: BLE001
                log(f"logprobs FAILED: {exc!r}")
        if attention == "sdpa" and args.budgets:
            token_budgets(trainer, shape, batches["packed"], packed, device, rate,
                          [int(b) for b in args.budgets.split(",")], args.repeats)
        if attention == "sdpa" and "diag" not in skip:
            diagnose(trainer, shape, batches, {"packed": packed, "single": single}, rows, seq, device, rate)
        if attention == "sdpa" and "profile" not in skip:
            profile_step(trainer, batches["packed"], device)
        trainer = None
        free(params)
        params = None
        free()

    if "fused" not in skip and not dry:
        log("building the sdpa trainer with Megatron's SwiGLU / bias-dropout-add fusions (torch.compile)")
        try:
            trainer = build_trainer(shape, "sdpa", device, bf16, seq,
                                    {"bias_activation_fusion": True, "bias_dropout_fusion": True})
            step_runs(trainer, "sdpa+fusions step packed", "packed", "sdpa")
            step_runs(trainer, "sdpa+fusions step single", "single", "sdpa")
            trainer = None
            free()
        except Exception as exc:  # noqa: BLE001
            log(f"fused variant FAILED: {exc!r}")
            traceback.print_exc()

    print_table(rate)
    dist.destroy_process_group()


def print_table(rate) -> None:
    from bench.runner import table  # noqa: WPS433 (the repo's table printer)

    rows = []
    for r in RESULTS:
        if r.get("kind") != "timing" or "error" in r or "model_tflops" not in r:
            continue
        main = r.get("step_s", r.get("fwd_bwd_s"))
        rows.append([
            r["name"], r["tokens"], round(main * 1e3, 1),
            round(r.get("fwd_bwd_s", 0) * 1e3, 1), round(r.get("optim_s", 0) * 1e3, 1),
            round(r["tokens_per_s"]), round(r["model_tflops"], 1),
            round(100 * r["mfu_mm"], 1) if r.get("mfu_mm") else "-",
            round(100 * r["mfu_causal_mm"], 1) if r.get("mfu_causal_mm") else "-",
            round(100 * r["mfu_989"], 1),
            round(r["peak_mem_gib"], 1) if r.get("peak_mem_gib") else "-",
        ])
    print()
    if rate:
        print(f"bf16 matmul (8192^3, random): {rate / 1e12:.1f} TFLOP/s")
    for r in RESULTS:
        if r.get("kind") == "check" and "logits_rel_err" in r:
            print(f"check {r['name']}: logits rel err {r['logits_rel_err']:.2e}, qkv grad rel err "
                  f"{r['qkv_grad_rel_err']:.2e}")
        elif r.get("kind") in ("check", "diag"):
            fields = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("kind", "name"))
            print(f"{r['kind']} {r['name']}: {fields}")
        if r.get("kind") == "timing" and "error" in r:
            print(f"FAILED {r['name']}: {r['error']}")
    print(table(["run", "tokens", "ms", "fwd+bwd ms", "optim ms", "tok/s", "TFLOP/s", "%mm", "%mm causal",
                 "%989", "GiB"], rows))
    if OUT_DIR is not None:
        (OUT_DIR / "bench_gpu.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
