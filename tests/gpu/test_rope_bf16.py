"""rlfw's compiled RoPE in bf16 on the GPU (run on the device: BENCHMARKS.md says when and where), against
Megatron's unfused RoPE on the same inputs and fp32 math. CPU runs skip it; the formula and Megatron's hook are
pinned in CI by ``tests/megatron/test_rope.py``."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from rlfw.megatron import rope


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU: run on the device (BENCHMARKS.md)")
@pytest.mark.parametrize("seq", [4096, 3000])  # two lengths: one compiled kernel serves both (dynamic shapes)
def test_compiled_rope_is_as_close_to_fp32_math_as_megatrons(seq):
    """Queries of the Qwen2-1.5B shape (12 heads of 128), Megatron's angles for theta 1e6: the compiled kernel's
    output and input gradient lie as close to fp32 math as Megatron's unfused bf16 RoPE does (bf16 round-off)."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(seq)
    t = torch.randn(seq, 1, 12, 128, generator=g, device=device).bfloat16()
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=device) / 128))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)
    freqs = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    upstream = torch.randn(seq, 1, 12, 128, generator=g, device=device).bfloat16()

    def run(fn, dtype):
        x = t.to(dtype).clone().requires_grad_(True)
        out = fn(x, freqs)
        (grad,) = torch.autograd.grad(out, x, upstream.to(dtype))
        return out.float(), grad.float()

    exact = run(rope.rope_reference, torch.float32)
    errors = {}
    for name, fn in (("compiled", rope.rope), ("megatron", rope_utils._apply_rotary_pos_emb_bshd)):
        value, grad = run(fn, torch.bfloat16)
        errors[name] = ((value - exact[0]).abs().max().item(), (grad - exact[1]).abs().max().item())
    assert errors["compiled"][0] <= errors["megatron"][0] and errors["compiled"][1] <= errors["megatron"][1], errors
    assert max(errors["compiled"]) < 0.05, errors  # bf16 round-off of values of order 1-4
