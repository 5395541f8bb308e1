"""RolloutBatch: the unit of data between rollout and training, and the one split function for all policies.

A batch has two kinds of keys. *Per-sample* keys are columns (one entry per sample) and are partitioned by a split.
*Per-batch* keys (the dynamic global batch size, raw rewards kept for logging, totals) are copied into every part,
because every replica needs them. Keeping the two kinds in two dicts means no key can be dropped by a split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

from rlfw.data.partition import partition, workload_cost

# A minibatch's sample ids (in order) as a 52-bit integer, set with its minibatch_index: replicas compare it before
# they commit a step (rlfw.ft.agreement), so a replica sent other data cannot commit with them.
SAMPLE_IDS_DIGEST = "sample_ids_digest"
# The global loss denominators of one optimizer step travel with the data under this per-batch key.
DYNAMIC_GBS = "dynamic_global_batch_size"


@dataclass
class RolloutBatch:
    samples: Dict[str, List[Any]]
    meta: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lengths = {key: len(column) for key, column in self.samples.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"per-sample columns differ in length: {lengths}")

    def __len__(self) -> int:
        return len(next(iter(self.samples.values()))) if self.samples else 0

    @property
    def sample_ids(self) -> List[int]:
        return self.samples["sample_id"]

    def response_lengths(self) -> List[int]:
        return [len(t) - p for t, p in zip(self.samples["tokens"], self.samples["prompt_len"])]

    def trained_lengths(self) -> List[int]:
        """Loss-carrying tokens per sample: its response tokens, less an episode's environment tokens (the column
        ``loss_mask``, 0 on them), which are context only."""
        if "loss_mask" not in self.samples:
            return self.response_lengths()
        return [int(sum(mask)) for mask in self.samples["loss_mask"]]

    def num_response_tokens(self) -> int:
        """The policy's response tokens, the ones the loss is normalised over."""
        return sum(self.trained_lengths())

    def select(self, indices: Sequence[int]) -> "RolloutBatch":
        """The samples at ``indices`` (in that order); per-batch keys reach the result unchanged."""
        return RolloutBatch({k: [col[i] for i in indices] for k, col in self.samples.items()}, dict(self.meta))

    def num_minibatches(self, global_batch_size: int) -> int:
        """How many ``minibatches(global_batch_size)`` returns, without building them."""
        size = global_batch_size or len(self)
        return -(-len(self) // size) if size else 0

    def minibatches(self, global_batch_size: int) -> List["RolloutBatch"]:
        """Consecutive optimizer-step batches of ``global_batch_size`` samples (0 = one step on everything).

        Each carries its own dynamic global batch size: the sample and response-token counts that every replica
        normalises its loss by, whatever share of the minibatch it trains.
        """
        size = global_batch_size or len(self)
        parts = [self.select(range(start, min(start + size, len(self)))) for start in range(0, len(self), size)]
        for index, part in enumerate(parts):
            part.meta[DYNAMIC_GBS] = {"num_samples": len(part), "num_tokens": part.num_response_tokens()}
            part.meta["minibatch_index"] = index
            part.meta[SAMPLE_IDS_DIGEST] = ids_digest(part.sample_ids)
        return parts


def ids_digest(ids: Sequence[int]) -> int:
    return int(hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:13], 16)


@dataclass
class EagerParts:
    """A minibatch split at rollout time: one object ref per planned replica, and the sample ids of each part
    (small), so every participant knows who trained what without fetching the others' data."""

    refs: List[Any]
    sample_ids: List[List[int]]
    meta: Dict[str, Any]  # the minibatch's step and minibatch_index: where it is in the run, without a fetch


def split_batch(batch: RolloutBatch, num_parts: int, how: str, attention_weight: float = 0.0) -> List[RolloutBatch]:
    """Partition ``batch`` into ``num_parts`` parts (some may be empty) by policy ``how`` (strided | balanced).

    Balanced partitions equalise the training workload of whole sequences (prompt + response), which is what a
    replica's forward/backward time depends on.
    """
    if how == "balanced":
        lengths = [len(t) for t in batch.samples["tokens"]]
        costs_or_n = workload_cost(lengths, attention_weight=attention_weight)
    else:
        costs_or_n = len(batch)
    return [batch.select(indices) for indices in partition(costs_or_n, num_parts, how)]
