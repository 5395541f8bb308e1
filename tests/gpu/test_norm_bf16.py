"""rlfw's compiled RMSNorm in bf16 on the GPU (run on the device: BENCHMARKS.md says when and where), against
torch's RMSNorm on the same inputs and fp32 math. CPU runs skip it; the formula and the swap are pinned in CI by
``tests/megatron/test_norm.py``."""

import pytest
import torch

from rlfw.megatron.norm import CompiledRMSNorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU: run on the device")


@pytest.mark.parametrize("tokens", [16384, 3001])  # two lengths: one compiled graph serves both (dynamic tokens)
def test_compiled_rmsnorm_rounds_fp32_math_once_and_its_gradients_match_torchs(tokens):
    """Hidden states of the Qwen2-1.5B width in [seq, batch, hidden]: every output element is fp32 math rounded
    once (within one bf16 ulp of it), and both gradients lie as close to fp32 math as torch's bf16 RMSNorm's."""
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(tokens)
    x = (torch.randn(tokens, 1, 1536, generator=g, device=device) * 3).bfloat16()
    weight = (1 + 0.1 * torch.randn(1536, generator=g, device=device)).bfloat16()
    upstream = torch.randn(tokens, 1, 1536, generator=g, device=device).bfloat16()

    def run(cls, dtype):
        norm = cls(1536, eps=1e-6, device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        xi = x.to(dtype).clone().requires_grad_(True)
        out = norm(xi)
        gx, gw = torch.autograd.grad(out, (xi, norm.weight), upstream.to(dtype))
        return out.float(), gx.float(), gw.float()

    exact = run(torch.nn.RMSNorm, torch.float32)
    ours = run(CompiledRMSNorm, torch.bfloat16)
    torchs = run(torch.nn.RMSNorm, torch.bfloat16)

    ulp = exact[0].abs() * 2.0**-8 + 1e-30  # bf16 keeps 8 significant bits: one rounding is within half of this
    assert ((ours[0] - exact[0]).abs() <= ulp).all()
    for name, a, b, e in zip(("value", "grad x", "grad w"), ours, torchs, exact):
        err_ours, err_torch = (a - e).abs().max().item(), (b - e).abs().max().item()
        assert err_ours <= 1.5 * err_torch, (name, err_ours, err_torch)
