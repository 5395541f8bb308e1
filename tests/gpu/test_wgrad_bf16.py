"""The weight-gradient accumulation into fp32 main gradients on the GPU (run on the device: BENCHMARKS.md says when
and where): this torch has the op, and the GEMM's fp32 accumulation is at least as close to fp32 math as the bf16
weight gradient added afterwards (what Megatron DDP does without the fusion). CPU runs skip it; the routing through
Megatron is pinned in CI by ``tests/megatron/test_wgrad.py``."""

import pytest
import torch

from rlfw.megatron import wgrad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU: run on the device (BENCHMARKS.md)")
def test_fused_accumulation_is_as_close_to_fp32_math_as_the_separate_addition():
    device = torch.device("cuda")
    assert wgrad.works_on(device)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(16384, 1536, generator=g, device=device).bfloat16()  # fc1's input, a 16k-token micro-batch
    dy = (torch.randn(16384, 2048, generator=g, device=device) * 1e-2).bfloat16()
    start = torch.randn(2048, 1536, generator=g, device=device)
    exact = start + dy.float().t() @ x.float()
    fused = start.clone()
    wgrad.accumulate_fp32(x, dy, fused)
    separate = start + (dy.t() @ x).float()
    err_fused, err_separate = (fused - exact).abs().max().item(), (separate - exact).abs().max().item()
    assert err_fused <= err_separate, (err_fused, err_separate)
    assert err_fused < 1e-2 * exact.abs().max().item()
