"""Weight gradients accumulated into Megatron DDP's fp32 main gradients inside the GEMM, on CUDA without Apex.

Why: Megatron's linear layers compute each micro-batch's weight gradient in bf16, and DDP's backward hook then adds
it into the weight's fp32 main gradient: one more element-wise pass over every weight, per micro-batch (56 ms of a
1.49 s step of the 1.5B model on the H100, BENCHMARKS.md). With ``TransformerConfig.gradient_accumulation_fusion``
Megatron lets the weight-gradient GEMM accumulate into the main gradient itself (beta = 1, fp32 output), through
Apex's ``fused_weight_gradient_mlp_cuda``. PyTorch's ``addmm`` with ``out_dtype`` is the same cuBLAS call: ``install``
gives Megatron an object with Apex's two functions built on it (the sum is also accumulated in fp32 rather than
rounded to bf16 first).

How Megatron reaches it: ``megatron.core.tensor_parallel.layers`` imports Apex's module at import time and keeps it,
with the flag ``_grad_accum_fusion_available``, as module globals (megatron-core 0.16.1 and 0.19.2 alike). They are
private: ``tests/megatron/test_wgrad.py`` pins that Megatron's linear layers call ``WGRAD_ACCUMULATE`` with the main
gradients and that these equal the unfused weight gradients. ``install`` first runs the op on the device and leaves
the fusion off where this torch lacks it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch


def accumulate_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (the [tokens, in] input and the [tokens, out] output gradient of
    a linear layer), accumulated by the GEMM in fp32 (Apex's ``wgrad_gemm_accum_fp32``)."""
    if total_input.dtype == main_grad.dtype:  # fp32 training (the CPU path)
        main_grad.addmm_(grad_output.t(), total_input)
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


def accumulate_same_dtype(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """The same for bf16 or fp16 main gradients (Apex's ``wgrad_gemm_accum_fp16``)."""
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


WGRAD_ACCUMULATE = SimpleNamespace(wgrad_gemm_accum_fp32=accumulate_fp32, wgrad_gemm_accum_fp16=accumulate_same_dtype)


def add_weight_grad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` for any caller holding an fp32 sum of weight gradients (the
    chunked output head): inside the GEMM where this torch can, else the product in the inputs' dtype added
    afterwards."""
    if total_input.dtype == main_grad.dtype or works_on(main_grad.device):
        accumulate_fp32(total_input, grad_output, main_grad)
    else:
        main_grad.add_(grad_output.t() @ total_input)


@functools.lru_cache(maxsize=None)
def works_on(device: torch.device) -> bool:
    """Whether this torch runs the mixed-precision accumulation on ``device``, with the right sum (probed once per
    device)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 32, generator=g, device=device).bfloat16()
    dy = torch.randn(64, 16, generator=g, device=device).bfloat16()
    main_grad = torch.ones(16, 32, device=device)
    try:
        accumulate_fp32(x, dy, main_grad)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    expected = 1 + dy.float().t() @ x.float()
    return bool(torch.allclose(main_grad, expected, rtol=1e-3, atol=1e-3))


def install() -> bool:
    """Let Megatron's ``gradient_accumulation_fusion`` reach ``WGRAD_ACCUMULATE`` on CUDA where Apex is absent;
    returns whether a fused accumulation is there now."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        if not torch.cuda.is_available() or not works_on(torch.device("cuda", torch.cuda.current_device())):
            return False
        layers.fused_weight_gradient_mlp_cuda = WGRAD_ACCUMULATE
        layers._grad_accum_fusion_available = True
    return True
