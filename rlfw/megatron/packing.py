"""Pack variable-length samples into micro-batches under a token budget, with no padding.

A micro-batch is one row holding several sequences back to back. A block-diagonal causal mask keeps each sequence
attending only to itself, and position ids restart at every sequence, so a packed row computes exactly what the
sequences would compute one by one (the local attention spec accepts an explicit mask; THD packing needs
Transformer Engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int) -> List[List[int]]:
    """First-fit-decreasing bins of sample indices whose lengths sum to at most ``max_tokens``.

    Deterministic; a sample longer than the budget is an error (the rollout truncates to ``model.max_seq_len``
    and the config guarantees the budget is at least that).
    """
    bins: List[List[int]] = []
    room: List[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        if length > max_tokens:
            raise ValueError(f"sample of {length} tokens exceeds the micro-batch budget of {max_tokens} tokens")
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(max_tokens - length)
    return [sorted(b) for b in bins]


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    attention_mask: torch.Tensor  # [1, 1, T, T], True = masked
    labels: torch.Tensor  # [1, T]: the next token of the same sequence (0 where none)
    loss_weight: torch.Tensor  # [1, T]: weight of the token's loss; 0 on prompts and sequence ends
    advantages: torch.Tensor  # [1, T]
    old_logprobs: Optional[torch.Tensor]  # [1, T]
    ref_logprobs: Optional[torch.Tensor]  # [1, T]
    response_slices: List[slice]  # per sample: positions whose logits predict its response tokens

    def to(self, device) -> "MicroBatch":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**moved)


def token_weights(batch: RolloutBatch, loss_agg: str) -> List[float]:
    """Per-sample weight of each response token, normalised by the step's *global* denominators."""
    gbs: Dict[str, int] = batch.meta[DYNAMIC_GBS]
    if loss_agg == "token_mean":
        return [1.0 / max(gbs["num_tokens"], 1)] * len(batch)
    if loss_agg == "sample_mean":
        return [1.0 / (max(n, 1) * gbs["num_samples"]) for n in batch.response_lengths()]
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")


def build_microbatch(batch: RolloutBatch, indices: Sequence[int], weights: Optional[Sequence[float]]) -> MicroBatch:
    """One packed row from the samples at ``indices``; ``weights`` None builds a forward-only micro-batch."""
    tokens, positions, labels, loss_weight, advantages, old_lp, ref_lp, slices = [], [], [], [], [], [], [], []
    has_old = "old_logprobs" in batch.samples
    has_ref = "ref_logprobs" in batch.samples
    offset = 0
    for i in indices:
        seq = batch.samples["tokens"][i]
        p = batch.samples["prompt_len"][i]
        n = len(seq)
        r = n - p
        tokens += seq
        positions += range(n)
        labels += seq[1:] + [0]
        # Position j predicts token j+1: the response tokens p..n-1 are predicted at positions p-1..n-2.
        mask = [0.0] * (p - 1) + [1.0] * r + [0.0]
        w = weights[i] if weights is not None else 0.0
        loss_weight += [m * w for m in mask]
        advantages += [batch.samples["advantage"][i] if "advantage" in batch.samples else 0.0] * n
        pad = [0.0] * (p - 1)
        if has_old:
            old_lp += pad + list(batch.samples["old_logprobs"][i]) + [0.0]
        if has_ref:
            ref_lp += pad + list(batch.samples["ref_logprobs"][i]) + [0.0]
        slices.append(slice(offset + p - 1, offset + n - 1))
        offset += n
    T = len(tokens)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    lengths = torch.tensor([len(batch.samples["tokens"][i]) for i in indices])
    seq_id = torch.repeat_interleave(torch.arange(len(indices)), lengths)
    allowed = causal & (seq_id[:, None] == seq_id[None, :])

    def row(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype).unsqueeze(0)

    return MicroBatch(
        tokens=row(tokens, torch.long),
        position_ids=row(positions, torch.long),
        attention_mask=(~allowed).view(1, 1, T, T),
        labels=row(labels, torch.long),
        loss_weight=row(loss_weight),
        advantages=row(advantages),
        old_logprobs=row(old_lp) if has_old else None,
        ref_logprobs=row(ref_lp) if has_ref else None,
        response_slices=slices,
    )


def microbatches(
    batch: RolloutBatch, max_tokens: int, loss_agg: Optional[str] = None
) -> List[tuple[List[int], MicroBatch]]:
    """Pack ``batch`` into micro-batches; returns (sample indices, micro-batch) pairs."""
    weights = token_weights(batch, loss_agg) if loss_agg else None
    lengths = [len(t) for t in batch.samples["tokens"]]
    return [(b, build_microbatch(batch, b, weights)) for b in pack_by_token_budget(lengths, max_tokens)]
