"""Pack variable-length samples into micro-batches under a token budget, with no padding.

A micro-batch is one row holding several sequences back to back. Cumulative sequence offsets (``cu_seqlens``) keep
each sequence attending only to itself (``rlfw.megatron.attention.PackedRow`` carries them to the core attention),
and position ids restart at every sequence, so a packed row computes exactly what the sequences would compute one
by one. Megatron's own unfused attention takes no offsets: for it the row also carries the equivalent dense
block-diagonal causal mask (``dense_mask=True``), a T x T tensor built on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

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
    attention_mask: Optional[torch.Tensor]  # [1, 1, T, T], True = masked; only for attention without offsets
    cu_seqlens: torch.Tensor  # [n + 1] int32: where each of the row's n sequences starts, then T
    max_seqlen: int  # the longest of the row's sequences
    labels: torch.Tensor  # [1, T]: the next token of the same sequence (0 where none)
    loss_weight: torch.Tensor  # [1, T]: weight of the token's loss; 0 on prompts and sequence ends
    advantages: torch.Tensor  # [1, T]
    old_logprobs: Optional[torch.Tensor]  # [1, T]
    ref_logprobs: Optional[torch.Tensor]  # [1, T]
    rollout_logprobs: Optional[torch.Tensor]  # [1, T]: the engine's, for truncated importance sampling
    response_slices: List[slice]  # per sample: positions whose logits predict its response tokens
    old_values: Optional[torch.Tensor] = None  # [1, T]: the critic's values before this rollout's updates (PPO)
    returns: Optional[torch.Tensor] = None  # [1, T]: GAE returns, the critic's targets (PPO)

    def to(self, device, non_blocking: bool = False) -> "MicroBatch":
        """``non_blocking`` stages host tensors in pinned memory: the copies then queue behind the device's work
        instead of waiting for it (a copy from pageable memory synchronises with the stream)."""
        pin = non_blocking and torch.device(device).type == "cuda"

        def move(v: torch.Tensor) -> torch.Tensor:
            return (v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=non_blocking)

        return MicroBatch(**{k: (move(v) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


def token_weights(batch: RolloutBatch, loss_agg: str) -> List[float]:
    """Per-sample weight of each response token, normalised by the step's *global* denominators.

    ``token_mean``: every token of the minibatch counts the same (1 / its tokens). ``sample_mean``: a sample's loss
    is the sum over its tokens, averaged over the minibatch's samples (1 / its samples). ``seq_mean_token_mean``:
    a sample's loss is the mean over its tokens, averaged over the samples (1 / (own tokens x samples)).
    """
    gbs: Dict[str, int] = batch.meta[DYNAMIC_GBS]
    if loss_agg == "token_mean":
        return [1.0 / max(gbs["num_tokens"], 1)] * len(batch)
    if loss_agg == "sample_mean":
        return [1.0 / gbs["num_samples"]] * len(batch)
    if loss_agg == "seq_mean_token_mean":
        return [1.0 / (max(n, 1) * gbs["num_samples"]) for n in batch.trained_lengths()]
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")


def build_microbatch(
    batch: RolloutBatch, indices: Sequence[int], weights: Optional[Sequence[float]], dense_mask: bool = False
) -> MicroBatch:
    """One packed row from the samples at ``indices``; ``weights`` None builds a forward-only micro-batch;
    ``dense_mask`` adds the T x T block-diagonal causal mask (for attention that takes no sequence offsets)."""
    tokens, positions, labels, loss_weight, advantages, slices = [], [], [], [], [], []
    per_token = {key: [] for key in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "old_values", "returns")
                 if key in batch.samples}
    offset = 0
    for i in indices:
        seq = batch.samples["tokens"][i]
        p = batch.samples["prompt_len"][i]
        n = len(seq)
        r = n - p
        tokens += seq
        positions += range(n)
        labels += seq[1:] + [0]
        # Position j predicts token j+1: the response tokens p..n-1 are predicted at positions p-1..n-2; an
        # episode's environment tokens among them are context (loss_mask 0), the policy's own are trained.
        response_mask = batch.samples["loss_mask"][i] if "loss_mask" in batch.samples else [1.0] * r
        mask = [0.0] * (p - 1) + list(response_mask) + [0.0]
        w = weights[i] if weights is not None else 0.0
        loss_weight += [m * w for m in mask]
        pad = [0.0] * (p - 1)
        advantage = batch.samples["advantage"][i] if "advantage" in batch.samples else 0.0
        # A list holds one advantage per response token; a number applies to the whole sequence.
        advantages += pad + list(advantage) + [0.0] if isinstance(advantage, (list, tuple)) else [advantage] * n
        for key, column in per_token.items():
            column += pad + list(batch.samples[key][i]) + [0.0]
        slices.append(slice(offset + p - 1, offset + n - 1))
        offset += n
    lengths = torch.tensor([len(batch.samples["tokens"][i]) for i in indices], dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))

    def row(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype).unsqueeze(0)

    return MicroBatch(
        tokens=row(tokens, torch.long),
        position_ids=row(positions, torch.long),
        attention_mask=block_causal_mask(lengths) if dense_mask else None,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()),
        labels=row(labels, torch.long),
        loss_weight=row(loss_weight),
        advantages=row(advantages),
        old_logprobs=row(per_token["old_logprobs"]) if "old_logprobs" in per_token else None,
        ref_logprobs=row(per_token["ref_logprobs"]) if "ref_logprobs" in per_token else None,
        rollout_logprobs=row(per_token["rollout_logprobs"]) if "rollout_logprobs" in per_token else None,
        response_slices=slices,
        old_values=row(per_token["old_values"]) if "old_values" in per_token else None,
        returns=row(per_token["returns"]) if "returns" in per_token else None,
    )


def block_causal_mask(lengths: torch.Tensor) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True = masked: causal within each of the sequences of ``lengths``, nothing across."""
    T = int(lengths.sum())
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & (seq_id[:, None] == seq_id[None, :])
    return (~allowed).view(1, 1, T, T)


def build_rows(
    batch: RolloutBatch, bins: Sequence[Sequence[int]], loss_agg: Optional[str] = None, dense_mask: bool = False
) -> Iterator[MicroBatch]:
    """The micro-batches of ``bins`` (from ``pack_by_token_budget``), built one at a time as they are consumed: a
    trainer that takes them one per forward step builds row i + 1 on the host while the device computes row i."""
    weights = token_weights(batch, loss_agg) if loss_agg else None
    for indices in bins:
        yield build_microbatch(batch, indices, weights, dense_mask)


def microbatches(
    batch: RolloutBatch, max_tokens: int, loss_agg: Optional[str] = None, dense_mask: bool = False
) -> List[tuple[List[int], MicroBatch]]:
    """Pack ``batch`` into micro-batches; returns (sample indices, micro-batch) pairs."""
    bins = pack_by_token_budget([len(t) for t in batch.samples["tokens"]], max_tokens)
    return list(zip(bins, build_rows(batch, bins, loss_agg, dense_mask)))
