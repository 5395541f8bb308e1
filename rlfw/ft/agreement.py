"""Replicas must agree on what a step means before they commit it.

Each participant contributes where the step is (RL step, minibatch index, a digest of the minibatch's sample ids),
its dynamic global batch size (samples, tokens), the participant count, and what its sync adds (a cell: the torchft
step and the quorum id). A MIN and a MAX all-reduce of the same vector disagree exactly when some replica differs;
the step is then discarded with an error naming both values.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from rlfw.data.batch import DYNAMIC_GBS, SAMPLE_IDS_DIGEST, RolloutBatch
from rlfw.ft.errors import FatalError

FIELDS = ("step", "minibatch_index", "sample_ids", "num_samples", "num_tokens", "num_participants")


class DisagreementError(FatalError):
    """Replicas computed different steps: a bug or corrupted data, not a failure a heal can fix."""


def agreement_vector(part: RolloutBatch, num_participants: int, extra: Optional[Dict[str, int]] = None
                     ) -> torch.Tensor:
    """FIELDS then ``extra``'s values, as float64 (every value is an integer below 2**53: exact). Keys a batch
    lacks (a hand-built one) count as 0."""
    gbs, meta = part.meta[DYNAMIC_GBS], part.meta
    values = [meta.get("step", 0), meta.get("minibatch_index", 0), meta.get(SAMPLE_IDS_DIGEST, 0),
              gbs["num_samples"], gbs["num_tokens"], num_participants, *(extra or {}).values()]
    return torch.tensor(values, dtype=torch.float64)


def verify_agreement(
    part: RolloutBatch, num_participants: int, allreduce: Callable[[torch.Tensor, str], torch.Tensor],
    extra: Optional[Dict[str, int]] = None, device: torch.device = torch.device("cpu"),
) -> None:
    """Raise DisagreementError unless every participant holds the same step description.

    ``allreduce(tensor, op)`` reduces across the participants with op "min" or "max" and returns the result;
    ``extra`` adds the sync's own fields (the same keys, in the same order, on every participant). The vectors are
    reduced on ``device``, the trainer's: an NCCL group has no CPU backend (Gloo takes CUDA tensors as well).
    """
    mine = agreement_vector(part, num_participants, extra)
    low, high = (allreduce(mine.to(device, copy=True), op).cpu() for op in ("min", "max"))
    names = FIELDS + tuple(extra or ())
    bad: List[str] = [
        f"{name}: {int(lo)} vs {int(hi)}" for name, lo, hi in zip(names, low.tolist(), high.tolist()) if lo != hi
    ]
    if bad:
        raise DisagreementError(
            "replicas disagree on the step, discarding it: " + "; ".join(bad) + f" (this replica: {mine.tolist()})"
        )
