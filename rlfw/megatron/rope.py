"""Fused rotary position embedding for Megatron's local layers on CUDA, without Transformer Engine.

Why: without TE, megatron-core applies RoPE to the queries and to the keys of every layer with about ten
element-wise kernels each way (the cosine and sine of the angles and their casts, the rotation's chunk, negation
and concatenation, two products, a sum, a final concatenation), each a full pass over a [tokens, heads, 128]
bf16 tensor. ``rope`` is the same formula as one ``torch.compile`` function: one kernel forward and one backward
(76-80 ms off a step of about 1.58 s on the H100, BENCHMARKS.md). It computes in fp32 and rounds once, where
Megatron's unfused RoPE (like the engines' HF and vLLM code) rounds the cosines, sines and products to bf16: in
bf16 the values differ at round-off level from before (closer to fp32 math, ``tests/gpu/test_rope_bf16.py``).

How Megatron reaches it: with ``TransformerConfig.apply_rope_fusion`` set, ``rope_utils.apply_rotary_pos_emb``
calls the module global ``rope_utils.fused_apply_rotary_pos_emb`` (Transformer Engine's, None without TE), for the
``sbhd`` layout that rlfw's packed rows use. ``install`` puts ``rope`` there when that global is None. It is a
private hook of megatron-core (0.16.1 and 0.19.2 alike): ``tests/megatron/test_rope.py`` pins that Megatron's
attention really calls it and that it equals Megatron's unfused RoPE. Interleaved rotary (``rotary_interleaved``,
which rlfw's models do not use) is refused; on CPU ``transformer_config`` leaves the fusion off (torch.compile
would need a compiler there).
"""

from __future__ import annotations

import torch


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (non-interleaved halves) on ``t`` [seq, batch, heads, dim], given the cosines and sines of the angles
    [seq, 1, 1, rot] in fp32 (rot <= dim; the rest of each head passes through); fp32 math, rounded once to ``t``'s
    dtype."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot].float(), t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    out = (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(t.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def rope_reference(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE with the angles ``freqs`` [seq, 1, 1, rot] (Megatron's rotary embedding), uncompiled."""
    freqs = freqs.float()
    return rotate(t, freqs.cos(), freqs.sin())


_compiled = None


def rope(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
         interleaved: bool = False) -> torch.Tensor:
    """``rope_reference`` with the signature of Megatron's ``fused_apply_rotary_pos_emb``: the cosines and sines
    are taken once per call on the angles (one row per token), and ``rotate`` runs compiled (dynamic shapes: packed
    rows differ in length). Taken inside the kernel, for every head again, the two kernels took 52 ms of device
    time a step on the H100; taken here, 39 ms (BENCHMARKS.md)."""
    global _compiled
    if interleaved or transpose_output_memory:
        raise NotImplementedError("rlfw's fused RoPE covers non-interleaved rotary without transposed output only")
    if _compiled is None:
        _compiled = torch.compile(rotate, dynamic=True, fullgraph=True)
    freqs = freqs.float()
    return _compiled(t, freqs.cos(), freqs.sin())


def install() -> bool:
    """Let Megatron's ``apply_rope_fusion`` reach ``rope`` (where Transformer Engine does not provide its kernel);
    returns whether a fused RoPE is there now."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rope
    return rope_utils.fused_apply_rotary_pos_emb is not None
