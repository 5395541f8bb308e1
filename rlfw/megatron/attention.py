"""Core attention for Megatron's *local* layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's own ``DotProductAttention`` materialises the whole ``[b, heads, s, s]`` score matrix (and its fp32
softmax) in every layer; ``SDPAttention`` is a drop-in replacement (same constructor and ``forward`` arguments as
``DotProductAttention`` in megatron-core 0.16.1 and 0.19.x, no parameters, same state dict) that lets PyTorch pick a
fused kernel (flash / memory-efficient on CUDA).

Inputs are what Megatron's ``SelfAttention`` passes to core attention: ``query`` ``[sq, b, np, hn]``, ``key`` and
``value`` ``[sk, b, ng, hn]`` (``ng`` query groups, GQA when ``ng < np``), an optional boolean ``attention_mask``
(True = masked, broadcastable to ``[b, 1, sq, sk]``), ``attn_mask_type`` and ``packed_seq_params``. The output is
``[sq, b, np * hn]``, as Megatron's.

Packed sequences come as offsets, never as a mask: ``packed_seq_params`` carries cumulative sequence lengths
(``cu_seqlens``), and each sequence runs causal attention on its own, through
``torch.nn.attention.varlen.varlen_attn`` (flash, variable length) on CUDA in bf16/fp16, else one causal SDPA call
per sequence, or, where padding costs little (``padding_pays``), one causal SDPA call over the sequences
right-padded to the longest (the CPU's short RL samples: a call costs more than its arithmetic there). Two
layouts: ``PackedRow`` (``qkv_format="sbhd"``: one ``[T, 1]`` row, the layout rlfw's packing uses, see its
docstring) and Megatron's THD (``qkv_format="thd"``: ``query`` ``[t, np, hn]``, output
``[t, np * hn]``).

Masks follow Megatron's unfused path exactly: a given mask is the whole truth (the mask type only matters when no
mask is given). A block-diagonal causal mask (what a caller packing rows for Megatron's own attention builds) is
recognised once per mask tensor and turned into offsets; any other mask goes to SDPA as an explicit boolean mask
(SDPA's convention is the opposite: True = attend). Rows whose mask hides every key are not supported (SDPA returns
NaN there; Megatron a uniform mix).

``PACKED_IMPL`` is the path of packed sequences: ``auto`` (varlen where usable, else one padded batch where padding
pays, else per sequence); the tests set ``varlen``, ``padded`` (always one padded batch), ``loop`` (per-sequence
SDPA) or ``mask`` (a recognised block mask goes to SDPA as it is) to hold the
paths against each other.
"""

from __future__ import annotations

import inspect
import itertools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

PACKED_IMPL = "auto"

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)

# --------------------------------------------------------------------------------------------- varlen (flash)
_VARLEN = None  # (function, parameter names) once looked up; False when unavailable


def _varlen_attn():
    global _VARLEN
    if _VARLEN is None:
        try:
            from torch.nn.attention.varlen import varlen_attn

            params = set(inspect.signature(varlen_attn).parameters)
            _VARLEN = (varlen_attn, params) if ("is_causal" in params or "window_size" in params) else False
        except (ImportError, AttributeError, TypeError, ValueError):
            _VARLEN = False
    return _VARLEN


def varlen_usable(query: Tensor, dropout_p: float) -> bool:
    """Whether the flash varlen kernel can run these inputs (CUDA, half precision, no dropout). The kernel is looked
    up last: its module imports TorchDynamo (over a second of a CPU trainer's start, for a kernel it cannot run)."""
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and dropout_p == 0.0
        and query.size(-1) % 8 == 0
        and query.size(-1) <= 256
        and bool(_varlen_attn())
    )


def _run_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                causal: bool, scale: float) -> Tensor:
    """Flash attention over packed ``[t, heads, dim]`` tensors; works across torch's varlen API revisions."""
    fn, params = _varlen_attn()
    kwargs = {}
    if "is_causal" in params:
        kwargs["is_causal"] = causal
    else:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(q.size(-1)), rel_tol=1e-12):
        q = q * (scale * math.sqrt(q.size(-1)))  # the kernel's default scale is 1/sqrt(dim)
    # Where torch's varlen API has no ``enable_gqa`` argument (torch 2.10/2.11), grouped K/V go to the flash kernel
    # as they are: FlashAttention handles GQA itself (on torch 2.11 + H200 outputs and dK/dV matched K/V repeated to
    # all heads exactly and dQ within 1e-5, and a layer's fwd+bwd took 1.21 ms instead of 1.58 ms).
    if k.size(1) != q.size(1) and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    out = fn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _repeat_kv(x: Tensor, heads: int, dim: int) -> Tensor:
    groups = x.size(dim)
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=dim)


# ------------------------------------------------------------------------------------------ packed rows
@dataclass
class PackedRow(PackedSeqParams):
    """Sequences packed back to back in one ``[T, 1]`` row: Megatron's ``packed_seq_params`` for ``SDPAttention``.

    Megatron hands ``packed_seq_params`` to core attention whatever its format. With ``qkv_format="sbhd"`` it keeps
    the row's ``[s, b, ...]`` layout and applies RoPE along the row (``max_seqlen_q`` = T is the RoPE table's
    length); that is the same function per sequence, because RoPE scores depend only on relative positions. Its THD
    format would apply RoPE per sequence instead, with a host sync and a Python loop in every layer (megatron-core
    0.16-0.19 without Transformer Engine). ``longest`` (the longest packed sequence) bounds the varlen kernel's grid.
    """

    longest: int = 0


def packed_row(cu_seqlens: Tensor, longest: int, row_len: int) -> PackedRow:
    """``PackedRow`` for a row of ``row_len`` tokens whose sequences start at ``cu_seqlens[:-1]`` (int32)."""
    return PackedRow(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=row_len,
                     max_seqlen_kv=row_len, longest=longest)


# ----------------------------------------------------------------------------------- packed-row recognition
_SEGMENTS: dict = {}  # id(mask) -> (weakref(mask), mask._version, segments); a handful of recent masks
_CU_SEQLENS: dict = {}  # (id(mask), rows, device) -> (weakref(mask), mask._version, (cu_seqlens, longest))


def _cached(cache: dict, key, mask: Tensor, compute):
    entry = cache.get(key)
    if entry is not None and entry[0]() is mask and entry[1] == mask._version:
        return entry[2]
    value = compute()
    if len(cache) >= 8:
        cache.clear()
    cache[key] = (weakref.ref(mask), mask._version, value)
    return value


def packed_cu_seqlens(mask: Tensor, lengths: list[int], rows: int, device) -> tuple[Tensor, int]:
    """``segments_to_cu_seqlens`` on ``device``, cached per mask like the segments: every layer reuses one device
    tensor (a host-to-device copy from pageable memory per layer would synchronise the stream each time)."""
    return _cached(_CU_SEQLENS, (id(mask), rows, str(device)), mask,
                   lambda: segments_to_cu_seqlens(lengths, device))


def block_causal_segments(mask: Tensor) -> list[list[int]] | None:
    """Per batch row of ``mask`` (bool ``[mb, 1, T, T]``, True = masked), the lengths of the sequences packed back to
    back, if the mask is exactly block-diagonal causal; None otherwise. Cached per mask tensor (all layers of one
    forward share it), so the check and its host sync happen once per micro-batch."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.size(1) != 1 or mask.size(2) != mask.size(3):
        return None
    return _cached(_SEGMENTS, id(mask), mask, lambda: _find_segments(mask))


@torch.no_grad()
def _find_segments(mask: Tensor) -> list[list[int]] | None:
    T = mask.size(-1)
    allowed = ~mask[:, 0]  # [mb, T, T]
    # Row i of a block-diagonal causal mask allows exactly the columns start(i)..i; start(i) = first allowed column.
    start = allowed.to(torch.uint8).argmax(dim=-1)  # [mb, T] (first maximum)
    positions = torch.arange(T, device=mask.device)
    is_start = start == positions
    seq_id = is_start.long().cumsum(dim=-1) - 1
    expected = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril() & (
        seq_id[:, :, None] == seq_id[:, None, :]
    )
    ok = is_start[:, 0].all() & (expected == allowed).all()
    host = torch.cat([ok.view(1), is_start.flatten()]).cpu()  # the one host sync of a micro-batch
    if not bool(host[0]):
        return None
    segments = []
    for row in host[1:].view(-1, T):
        starts = row.nonzero().flatten().tolist() + [T]
        segments.append([b - a for a, b in itertools.pairwise(starts)])
    return segments


# ----------------------------------------------------------------------------------------------- the module
class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for ``get_gpt_layer_local_spec`` (see the module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **_unused,
    ):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) != 1:
            raise NotImplementedError("SDPAttention does not support context parallelism")
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("SDPAttention does not support sliding-window attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("SDPAttention supports only the vanilla softmax")
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise NotImplementedError("SDPAttention does not track attention logits (qk_clip)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scores by layer_number and the fp32 softmax multiplies them
        # back: the identity, so the plain scale is the same function.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.current_max_attn_logits = None  # read by Attention only with qk_clip, which is refused above

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
        **extra,
    ) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support an attention bias")
        if any(v is not None for v in extra.values()):
            raise NotImplementedError(f"SDPAttention got unsupported arguments: {sorted(extra)}")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._attend(query, key, value, attention_mask, mask_type, packed_seq_params, dropout_p)
        return self._attend(query, key, value, attention_mask, mask_type, packed_seq_params, dropout_p)

    # ------------------------------------------------------------------------------------------------ paths
    def _attend(self, query, key, value, attention_mask, mask_type, packed_seq_params, dropout_p) -> Tensor:
        if packed_seq_params is not None:
            return self._offsets(query, key, value, mask_type, packed_seq_params, dropout_p)
        sq, b = query.shape[:2]
        sk = key.size(0)
        if attention_mask is None:
            causal = mask_type in _CAUSAL_TYPES and sq > 1
            if causal and sq != sk:  # queries are the last sq of sk positions (bottom-right aligned)
                keep = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(diagonal=sk - sq)
                return self._sdpa(query, key, value, keep, False, dropout_p)
            return self._sdpa(query, key, value, None, causal, dropout_p)
        segments = None
        if PACKED_IMPL != "mask" and sq == sk and attention_mask.size(0) in (1, b):
            segments = block_causal_segments(attention_mask)
        if segments is None:
            return self._sdpa(query, key, value, ~attention_mask, False, dropout_p)
        if attention_mask.size(0) == 1 and b > 1:
            segments = segments * b
        if PACKED_IMPL == "auto" and all(len(row) == 1 for row in segments):  # plain causal rows
            return self._sdpa(query, key, value, None, sq > 1, dropout_p)
        # rows one after another: [b * T, h, d]
        q, k, v = (x.transpose(0, 1).reshape(b * sq, x.size(2), x.size(3)) for x in (query, key, value))
        cu, longest = packed_cu_seqlens(attention_mask, [n for row in segments for n in row], b, q.device)
        out = self._by_offsets(q, k, v, cu, cu, longest, longest, True, dropout_p)  # [b * T, h * d]
        return out.view(b, sq, -1).transpose(0, 1).contiguous()

    def _sdpa(self, query, key, value, keep: Tensor | None, is_causal: bool, dropout_p: float) -> Tensor:
        """One SDPA call on ``[s, b, h, d]`` inputs; ``keep`` is a bool mask with True = attend."""
        sq, b, np_, hn = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        kwargs = {}
        if k.size(1) != np_:
            if keep is None and q.is_cuda:  # the flash kernel takes grouped K/V as they are
                kwargs["enable_gqa"] = True
            else:  # an explicit mask goes to kernels (memory-efficient, CPU) that want matching heads
                k, v = _repeat_kv(k, np_, dim=1), _repeat_kv(v, np_, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale, **kwargs
        )  # [b, h, sq, d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _offsets(self, query, key, value, mask_type, params, dropout_p) -> Tensor:
        """Sequences delimited by ``params.cu_seqlens_*``: a ``PackedRow`` (``[T, 1, ...]``) or THD (``[t, ...]``)."""
        fmt = getattr(params, "qkv_format", "thd")
        for padded, plain in (("cu_seqlens_q_padded", "cu_seqlens_q"), ("cu_seqlens_kv_padded", "cu_seqlens_kv")):
            p = getattr(params, padded, None)
            if p is not None and not torch.equal(p, getattr(params, plain)):
                raise NotImplementedError("SDPAttention: padded packed sequences are not supported")
        causal = mask_type in _CAUSAL_TYPES
        max_q, max_k = params.max_seqlen_q, params.max_seqlen_kv
        if fmt == "sbhd":
            if query.size(1) != 1:
                raise NotImplementedError(f"SDPAttention: a packed row has batch size 1, not {query.size(1)}")
            query, key, value = query[:, 0], key[:, 0], value[:, 0]
            max_q = max_k = getattr(params, "longest", 0) or max_q
        elif fmt != "thd":
            raise NotImplementedError(f"SDPAttention: packed_seq_params with qkv_format={fmt!r}")
        out = self._by_offsets(query, key, value, params.cu_seqlens_q, params.cu_seqlens_kv, max_q, max_k, causal,
                               dropout_p)  # [t, h * d]
        return out.unsqueeze(1) if fmt == "sbhd" else out

    def _padded(self, q: Tensor, k: Tensor, v: Tensor, lengths: list[int], dropout_p: float) -> Tensor:
        """Causal self-attention of ``[t, h, d]`` sequences packed back to back, as one batch right-padded to the
        longest: a real position attends only to the real positions before it, so the padding changes no output
        (padded positions are computed, then dropped). -> ``[t, h * d]``."""
        t, np_, hn = q.shape
        longest = max(lengths)
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                      torch.tensor(lengths, device=q.device))
        starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], device=q.device)
        pos = torch.arange(t, device=q.device) - starts[seq]

        def pad(x: Tensor) -> Tensor:  # [t, h, d] -> [longest, n, h, d]
            out = x.new_zeros(longest, len(lengths), x.size(1), x.size(2))
            return out.index_put((pos, seq), x)

        out = self._sdpa(pad(q), pad(k), pad(v), None, True, dropout_p)  # [longest, n, h * d]
        return out[pos, seq]

    def _by_offsets(self, q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, dropout_p: float) -> Tensor:
        """Attention of ``[t, h, d]`` sequences packed back to back (``cu_*``: int32 offsets) -> ``[t, h * d]``."""
        t, np_, hn = q.shape
        if PACKED_IMPL in ("auto", "varlen") and varlen_usable(q, dropout_p):
            max_q = max_q or int((cu_q[1:] - cu_q[:-1]).max())
            max_k = max_k or int((cu_k[1:] - cu_k[:-1]).max())
            out = _run_varlen(q, k, v, cu_q.int(), cu_k.int(), int(max_q), int(max_k), causal, self.softmax_scale)
            return out.reshape(t, np_ * hn)
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        if causal and bounds_q == bounds_k and PACKED_IMPL in ("auto", "padded"):
            lengths = [b - a for a, b in itertools.pairwise(bounds_q)]
            if PACKED_IMPL == "padded" or padding_pays(lengths):
                return self._padded(q, k, v, lengths, dropout_p)
        outs = []
        for (q0, q1), (k0, k1) in zip(itertools.pairwise(bounds_q), itertools.pairwise(bounds_k)):
            qs, ks, vs = q[q0:q1].unsqueeze(1), k[k0:k1].unsqueeze(1), v[k0:k1].unsqueeze(1)
            n_q, n_k = q1 - q0, k1 - k0
            if causal and n_q != n_k:
                keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
                outs.append(self._sdpa(qs, ks, vs, keep, False, dropout_p))
            else:
                outs.append(self._sdpa(qs, ks, vs, None, causal and n_q > 1, dropout_p))
        return torch.cat(outs, dim=0).reshape(t, np_ * hn)


def padding_pays(lengths: list[int]) -> bool:
    """Whether one SDPA call over the sequences right-padded to the longest beats one call per sequence: on the
    CPU a call costs far more than its arithmetic for short sequences, so the padded batch wins while its
    attention work (sequences x longest^2) stays within twice the sequences' own (the sum of their squares)."""
    return len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= 2 * sum(n * n for n in lengths)


def segments_to_cu_seqlens(lengths: list[int], device=None) -> tuple[Tensor, int]:
    """Cumulative sequence offsets (int32) and the longest length, as THD packing and varlen kernels take them."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu.to(device) if device is not None else cu, max(lengths)
