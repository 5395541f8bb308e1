"""A rank's part of a train call: its share of each minibatch, forward/backward, the step protocol around them.

``train_minibatches`` is what ``TrainerWorker.train`` runs, and what the protocol tests run with a model-free
trainer: the share of every participant comes from the same deterministic split (so a survivor can vouch for a peer
that died after a committed step), and the ``mid_forward_backward`` fault point sits between two micro-batches.
"""

from __future__ import annotations

from typing import Any, Dict, List

import ray

from rlfw.data.batch import RolloutBatch, split_batch
from rlfw.ft.protocol import GradSync, SyncHost, train_call


def train_minibatches(sync: GradSync, host: SyncHost, minibatches, call: Dict[str, Any], split
                      ) -> List[Dict[str, Any]]:
    """One optimizer step per minibatch not committed yet (``rlfw.ft.protocol.train_call``) on ``host``'s trainer.
    ``split``: how a minibatch is split over the participants (``split.how``, ``split.attention_weight``)."""
    sync.expect(call)

    def train_part(part):
        host.trainer.zero_grad()
        return forward_backward(host.trainer, part, host.faults, part.meta["step"])

    return train_call(sync, host, minibatches, lambda mb: mb.meta,
                      lambda mb, replica, count: take_part(mb, replica, count, split), train_part,
                      host.trainer.optimizer_step)


def take_part(minibatch, replica: int, num_replicas: int, split):
    """This replica's share, and the sample ids of every participant's share."""
    if isinstance(minibatch, RolloutBatch):  # delayed: split now, over this step's participants
        whole = minibatch
    elif len(minibatch.refs) == num_replicas:  # eager, as planned: fetch only this replica's object ref
        return ray.get(minibatch.refs[replica]), minibatch.sample_ids
    else:  # eager, but the participant set changed since the split was planned: re-split the union
        whole = merge(ray.get(list(minibatch.refs)))
    parts = split_batch(whole, num_replicas, split.how, split.attention_weight)
    return parts[replica], [list(p.sample_ids) for p in parts]


def forward_backward(trainer, part, faults, step: int) -> Dict[str, float]:
    """The trainer's forward/backward with the ``mid_forward_backward`` fault point after the first micro-batch's
    backward: before the second micro-batch, or at the end when there is only one (or an empty share), so the
    phase is reachable in every configuration."""
    reached = False

    def between_microbatches(index: int) -> None:
        nonlocal reached
        if index == 1:
            reached = True
            faults.maybe_fault("mid_forward_backward", step)

    sums = trainer.forward_backward(part, on_microbatch=between_microbatches)
    if not reached:
        faults.maybe_fault("mid_forward_backward", step)
    return sums


def merge(parts: List[RolloutBatch]) -> RolloutBatch:
    """The inverse of a split, in sample-id order: per-sample columns joined, per-batch keys from the first part."""
    columns = {k: [v for p in parts for v in p.samples[k]] for k in parts[0].samples}
    whole = RolloutBatch(columns, dict(parts[0].meta))
    return whole.select(sorted(range(len(whole)), key=lambda i: whole.sample_ids[i]))
