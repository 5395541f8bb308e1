"""RMSNorm as one compiled kernel each way, for Megatron's local layers on CUDA (without Transformer Engine).

Why: the local spec builds its norms as ``torch.nn.RMSNorm`` (Megatron's ``WrappedTorchNorm``). A Qwen2-1.5B step
runs 57 of them per micro-batch forward and backward, and in the H100 profile they took 39 ms of a 1430 ms step
(BENCHMARKS.md), about twice what their memory traffic needs. ``CompiledRMSNorm`` is the same module with its
formula compiled by ``torch.compile`` into one kernel forward and one backward (the weight's gradient included).

Numerics: fp32 math rounded once to the input's dtype, like ``rlfw.megatron.rope``. torch's unfused bf16 RMSNorm
(and the engines' HF code) rounds the normalised value to bf16 before the weight's product; in bf16 the two differ
at round-off level, the compiled one being the closer to fp32 math (``tests/gpu/test_norm_bf16.py``).

How it gets there: ``build_gpt`` calls ``compile_norms`` on a model that trains on CUDA. It replaces each
``torch.nn.RMSNorm`` (the layers' input and pre-MLP norms, Qwen3's query and key norms, the final norm) with a
``CompiledRMSNorm`` holding the very same weight parameter, so names, state dicts and checkpoints are unchanged.
It is a public-API swap of submodules, no private hook. On CPU nothing is replaced (torch.compile would need a
compiler there); ``tests/megatron/test_norm.py`` pins the formula and the swap in CI.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32 (or wider), rounded once to ``x``'s
    dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    out = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (out * weight.to(wide) if weight is not None else out).to(x.dtype)


_compiled = None


class CompiledRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward is ``rms_norm`` compiled on CUDA tensors (as is elsewhere). The leading
    (token) dimension is symbolic, so packed rows of any length share one graph; the normalised width stays a
    constant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _compiled
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if not x.is_cuda:
            return rms_norm(x, self.weight, eps)
        if _compiled is None:
            _compiled = torch.compile(rms_norm, fullgraph=True)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        return _compiled(x, self.weight, eps)


def compile_norms(model: torch.nn.Module, compiled: bool = True) -> int:
    """Swap every RMSNorm of ``model`` for a ``CompiledRMSNorm`` (``compiled=False``: back to ``torch.nn.RMSNorm``),
    keeping its weight parameter; returns how many were swapped. Call it before the optimizer is built or after:
    the parameters are the same objects."""
    target = CompiledRMSNorm if compiled else torch.nn.RMSNorm
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, torch.nn.RMSNorm) and type(child) is not target]
    for parent, name, old in swaps:
        new = target(old.normalized_shape, eps=old.eps, elementwise_affine=False)
        new.weight = old.weight  # the same Parameter (None without an affine weight)
        new.elementwise_affine = old.elementwise_affine
        new.train(old.training)
        setattr(parent, name, new)
    return len(swaps)
