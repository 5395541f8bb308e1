"""RMSNorm alone: forward + backward of one norm over ``[tokens, 1, hidden]`` bf16 hidden states, torch's
``RMSNorm`` (the local spec's) against ``rlfw.megatron.norm.CompiledRMSNorm``, at several token counts. A Qwen2-1.5B
step at the 16,384-token budget runs 57 norms per micro-batch, 4 micro-batches: the "step ms" column is 228 of them.
"""

from __future__ import annotations

import torch

from bench.gpu.head import _time
from rlfw.megatron.norm import CompiledRMSNorm

NORMS_PER_STEP = 57 * 4


def measure(tokens_list, hidden_size: int, device, repeats: int = 50) -> list[dict]:
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for tokens in tokens_list:
        x = torch.randn(tokens, 1, hidden_size, generator=g, device=device).bfloat16().requires_grad_(True)
        upstream = torch.randn(tokens, 1, hidden_size, generator=g, device=device).bfloat16()
        for name, cls in (("torch RMSNorm", torch.nn.RMSNorm), ("compiled RMSNorm (rlfw)", CompiledRMSNorm)):
            norm = cls(hidden_size, eps=1e-6, device=device, dtype=torch.bfloat16)

            def reset():
                x.grad = norm.weight.grad = None

            def step():
                reset()
                norm(x).backward(upstream)

            row = _time(step, reset, repeats)
            rows.append({"kind": "norm", "name": name, "tokens": tokens, "ms": row["ms"],
                         "step_ms": row["ms"] * NORMS_PER_STEP * 16384 / tokens})
        del x, upstream
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    from bench.runner import table as fmt

    return fmt(["norm", "tokens", "fwd+bwd ms", f"x {NORMS_PER_STEP} (16k-token step) ms"],
               [[r["name"], r["tokens"], round(r["ms"], 3), round(r["step_ms"], 1)] for r in rows])
