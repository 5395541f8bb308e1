"""``python -m bench.gpu``: the whole benchmark in one call (see the package docstring)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from bench.gpu import attribution, checks, head, setup, steps
from bench.gpu.data import packed_lengths, rollout_batch
from bench.gpu.model import QWEN2_1P5B, TINY, matmul_rate, matmul_weights
from bench.gpu.report import Results, log


def main() -> None:
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)  # NVLink multicast stays off on the lent machines (read at NCCL's start)
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/bench/gpu"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU, to test the script")
    parser.add_argument("--rows", type=int, default=8, help="rows of --seq tokens per step")
    parser.add_argument("--seq", type=int, default=4096, help="the longest sequence and the base token budget")
    parser.add_argument("--budgets", default="8192,16384", help="larger token budgets per micro-batch to time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", default="",
                        help="comma-separated: check,head,before,variants (unfused: just its SwiGLU row; rope, "
                             "wgrad, oldhead, oldoptim, oldfinite: just their rows of the code before),bare,"
                             "profile,recompute")
    parser.add_argument("--head-tokens", default="8192,16384,32768,65536", help="token counts of the head's own rows")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    dry = args.cpu_dry_run or not torch.cuda.is_available()
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    shape = TINY if dry else QWEN2_1P5B
    seq = min(args.seq, shape.max_seq_len)
    rows = 2 if dry else args.rows
    budgets = [seq] + [int(b) * seq // args.seq for b in filter(None, args.budgets.split(","))]

    import megatron.core

    rate = None if dry else matmul_rate()
    results = Results(Path(args.out), rate)
    results.record(kind="env", date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), torch=torch.__version__,
                   megatron_core=megatron.core.__version__, python=sys.version.split()[0], device=str(device),
                   gpu=None if dry else torch.cuda.get_device_name(0), shape=shape.__dict__,
                   matmul_weights=matmul_weights(shape), matmul_tflops=rate / 1e12 if rate else None)
    log(f"env: {json.dumps(results.rows[-1])}")

    setup.init_world(device)
    if "check" not in skip:
        checks.check_packed_attention(shape, device, results)
        setup.free()
    if "head" not in skip and not dry:
        for row in head.measure([int(t) for t in args.head_tokens.split(",")], shape.hidden_size, shape.vocab_size,
                                device):
            log(f"head: {json.dumps(results.record(**row))}")
        setup.free()

    rng = random.Random(0)
    lengths = {"packed": packed_lengths(rng, rows, seq, lo=max(16, seq // 32), hi=seq // 2), "single": [seq] * rows}
    batches = {"packed": rollout_batch(shape, lengths["packed"], seed=1),
               "single": rollout_batch(shape, lengths["single"], seed=2)}
    results.record(kind="data", **lengths)

    trainer = setup.build_trainer(shape, device, bf16=not dry, budget=seq)
    results.record(kind="build", dense_mask=trainer.dense_mask,
                   adam=[{k: g[k] for k in ("fused", "foreach")} for g in setup.adam_groups(trainer)])

    def timed(name, fn, data, within=contextlib.nullcontext, **extra):
        setup.free()  # and a fresh peak-memory count
        try:
            with within():
                runs = steps.repeat(fn, args.repeats)
            results.timing(name, shape, lengths[data], runs, data=data, **extra)
        except Exception as exc:  # noqa: BLE001  (one failed row must not lose the others)
            traceback.print_exc()
            results.failed(name, exc)

    def rlfw(budget, data, new=True):
        setup.use_path(trainer, new)
        trainer.algo.max_tokens_per_microbatch = budget
        return lambda: steps.rlfw_step(trainer, batches[data], device)

    # Before / after at the base budget: dense masks + foreach Adam (the old path) vs offsets + fused Adam.
    for data in ("packed", "single"):
        if "before" not in skip:
            timed(f"rlfw step {data} {seq}, masks + foreach Adam (before)", rlfw(seq, data, new=False), data)
        timed(f"rlfw step {data} {seq}, offsets + fused Adam", rlfw(seq, data), data)
    # Larger token budgets: the same sequences in fewer, longer rows.
    for budget in budgets[1:]:
        timed(f"rlfw step packed {budget}", rlfw(budget, "packed"), "packed", budget=budget)
    # Without Megatron's fused SwiGLU (bias_activation_fusion, on by default on CUDA), and with full activation
    # recompute (every layer's forward again in the backward): the config is read at every forward, so the same
    # trainer runs each variant and is set back after it.
    if "variants" not in skip and not dry:
        config = trainer.config
        if "unfused" not in skip:
            config.bias_activation_fusion = False
            timed(f"rlfw step packed {budgets[-1]}, unfused SwiGLU", rlfw(budgets[-1], "packed"), "packed",
                  budget=budgets[-1])
            config.bias_activation_fusion = True
        if "rope" not in skip:  # Megatron's unfused RoPE (about ten element-wise kernels per tensor and direction)
            config.apply_rope_fusion = False
            timed(f"rlfw step packed {budgets[-1]}, unfused RoPE", rlfw(budgets[-1], "packed"), "packed",
                  budget=budgets[-1])
            config.apply_rope_fusion = True
        if "wgrad" not in skip:  # DDP's separate fp32 addition of each micro-batch's weight gradients
            linear = [m for m in trainer.model.modules() if getattr(m, "gradient_accumulation_fusion", False)]
            for m in linear:  # the layers read the config when built: each one's own switch
                m.gradient_accumulation_fusion = False
            timed(f"rlfw step packed {budgets[-1]}, unfused weight-gradient accumulation", rlfw(budgets[-1], "packed"),
                  "packed", budget=budgets[-1])
            for m in linear:
                m.gradient_accumulation_fusion = True
        if "oldhead" not in skip:  # the head's kernels compiled with every size symbolic, bf16 weight-grad products
            timed(f"rlfw step packed {budgets[-1]}, head compiled as before", rlfw(budgets[-1], "packed"), "packed",
                  within=head.as_before, budget=budgets[-1])
        if "oldfinite" not in skip:  # the finite check as torch.isfinite on chunks
            timed(f"rlfw step packed {budgets[-1]}, isfinite check (before)", rlfw(budgets[-1], "packed"), "packed",
                  within=setup.isfinite_check, budget=budgets[-1])
        if "oldoptim" not in skip:  # Megatron's per-tensor loops for the grad norm and the clipping
            timed(f"rlfw step packed {budgets[-1]}, Megatron's optimizer loops", rlfw(budgets[-1], "packed"),
                  "packed", within=setup.megatron_fallbacks, budget=budgets[-1])
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
        timed(f"rlfw step packed {budgets[-1]}, full recompute", rlfw(budgets[-1], "packed"), "packed",
              budget=budgets[-1])
        config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None
    # Bare Megatron on the same rows, prebuilt on the device.
    setup.use_path(trainer, True)
    if "bare" not in skip:  # as a user gets it (no rlfw kernel), and once with rlfw's kernels under it
        for budget, within in ((budgets[0], True), (budgets[-1], True), (budgets[-1], False)):
            rows_on_device = steps.device_rows(batches["packed"], budget, device)
            timed(f"bare Megatron step packed {budget}" + ("" if within else ", rlfw's kernels"),
                  lambda r=rows_on_device: steps.bare_step(trainer, r, device), "packed",
                  within=(lambda: setup.as_shipped(trainer)) if within else contextlib.nullcontext, budget=budget)
            del rows_on_device
    if "profile" not in skip:
        out = Path(args.out)
        best = budgets[-1]
        profiled = [("rlfw", rlfw(best, "packed"))]
        if "bare" not in skip:  # as a user gets it
            best_rows = steps.device_rows(batches["packed"], best, device)
            profiled.append(("bare", lambda: steps.bare_step(trainer, best_rows, device)))
        for name, fn in profiled:
            try:
                with setup.as_shipped(trainer) if name == "bare" else contextlib.nullcontext():
                    fn()
                    row = attribution.attribute(fn, device, out / f"profile_{name}_{best}.txt")
                results.record(kind="profile", name=f"{name} step packed {best}", **row)
                log(f"profile {name}: {row}")
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                results.failed(f"profile {name}", exc)

    # Selective recompute of the MLP (model.recompute=selective): Megatron reads it when it builds the layers, so it
    # takes a trainer of its own, built after the first is freed (its peak memory must not count the first's).
    if "recompute" not in skip:
        trainer = best_rows = None
        setup.free()
        trainer = setup.build_trainer(shape, device, bf16=not dry, budget=seq, recompute="selective")
        for chunk in (trainer.algo.head_chunk_tokens, 1024):
            trainer.algo.head_chunk_tokens = chunk
            for budget in budgets[1:]:
                timed(f"rlfw step packed {budget}, MLP recompute, head chunk {chunk}", rlfw(budget, "packed"),
                      "packed", budget=budget)

    print()
    if rate:
        print(f"bf16 matmul (8192^3, random): {rate / 1e12:.1f} TFLOP/s")
    for r in results.rows:
        if r["kind"] in ("check", "profile", "error"):
            print(r["kind"], ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in r.items() if k != "kind"))
    print(results.table())
    head_rows = [r for r in results.rows if r["kind"] == "head"]
    if head_rows:
        print(head.table(head_rows))
    results.write_summary()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
