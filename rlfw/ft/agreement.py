"""Replicas must agree on what a step means before they commit it.

Each participant contributes the step's dynamic global batch size (samples, tokens), the participant count and its
minibatch index. A MIN and a MAX all-reduce of the same vector disagree exactly when some replica differs; the
step is then discarded with an error naming both values.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from rlfw.ft.errors import FatalError

from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch

FIELDS = ("num_samples", "num_tokens", "num_participants", "minibatch_index")


class DisagreementError(FatalError):
    """Replicas computed different steps: a bug or corrupted data, not a failure a heal can fix."""


def agreement_vector(part: RolloutBatch, num_participants: int) -> torch.Tensor:
    gbs = part.meta[DYNAMIC_GBS]
    values = [gbs["num_samples"], gbs["num_tokens"], num_participants, part.meta.get("minibatch_index", 0)]
    return torch.tensor(values, dtype=torch.float64)


def verify_agreement(
    part: RolloutBatch, num_participants: int, allreduce: Callable[[torch.Tensor, str], torch.Tensor]
) -> None:
    """Raise DisagreementError unless every participant holds the same step description.

    ``allreduce(tensor, op)`` reduces across the participants with op "min" or "max" and returns the result.
    """
    mine = agreement_vector(part, num_participants)
    low, high = allreduce(mine.clone(), "min"), allreduce(mine.clone(), "max")
    bad: List[str] = [
        f"{name}: {int(lo)} vs {int(hi)}" for name, lo, hi in zip(FIELDS, low.tolist(), high.tolist()) if lo != hi
    ]
    if bad:
        raise DisagreementError(
            "replicas disagree on the step, discarding it: " + "; ".join(bad) + f" (this replica: {mine.tolist()})"
        )
