"""Rollout batches of random tokens with given sequence lengths: packed rows of many sequences, or rows of one."""

from __future__ import annotations

import math
import random

from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch
from rlfw.model.shape import ModelShape


def packed_lengths(rng: random.Random, rows: int, budget: int, lo: int, hi: int) -> list[int]:
    """Sequence lengths that fill ``rows`` rows of ``budget`` tokens exactly (uniform in [lo, hi]; the last of each
    row takes what is left, split in two where that is more than ``hi``)."""
    lengths = []
    for _ in range(rows):
        left = budget
        while left > hi + lo:
            n = rng.randint(lo, hi)
            lengths.append(n)
            left -= n
        lengths += [left // 2, left - left // 2] if left > hi else [left]
    rng.shuffle(lengths)
    return lengths


def rollout_batch(shape: ModelShape, lengths, seed: int = 0) -> RolloutBatch:
    """A GRPO batch: prompts of a quarter of each sequence, random advantages, old log-probs near a random model's
    (-log V), so PPO ratios start near 1."""
    rng = random.Random(seed)
    cols = {k: [] for k in ("sample_id", "group_id", "tokens", "prompt_len", "advantage", "old_logprobs")}
    for i, n in enumerate(lengths):
        p = max(1, min(n - 1, n // 4))
        cols["sample_id"].append(i)
        cols["group_id"].append(i // 8)
        cols["tokens"].append([rng.randrange(shape.vocab_size) for _ in range(n)])
        cols["prompt_len"].append(p)
        cols["advantage"].append(rng.gauss(0.0, 1.0))
        cols["old_logprobs"].append([-math.log(shape.vocab_size) + rng.gauss(0.0, 0.1) for _ in range(n - p)])
    batch = RolloutBatch(cols, {"step": 0})
    batch.meta[DYNAMIC_GBS] = {"num_samples": len(batch), "num_tokens": batch.num_response_tokens()}
    return batch
