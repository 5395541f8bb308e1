"""The roles of an RL step: each a model the step trains, with its train group, treated alike by the loop.

A role is a train group (``rlfw.train_group.group.TrainGroup``: classic or cells) plus what the role adds to the
step: the columns its pre-update pass attaches to the batch, the columns it needs after the advantages, and the
names its figures are logged under. The policy is the first role (its weights serve the engines); PPO adds the
critic. Role replica ``i`` pairs with replica ``i`` of every other role (the same cell ids, the same shares).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import ray

from rlfw.algo.gae import explained_variance, returns
from rlfw.algo.losses import old_logprobs_from_training
from rlfw.data.batch import RolloutBatch
from rlfw.data.partition import strided_partition
from rlfw.train_group.group import TrainGroup


class Role:
    """``name``: the trainer's role (``actor`` or ``critic``): its fault target, its directory in a checkpoint
    and its key in an interrupted step's record."""

    name = ""
    event_role: Optional[str] = None  # the ``role`` field of its group's events (None: the policy's, unmarked)
    ledger_prefix = ""  # its weight digests' key in the ledger: ``<prefix>weight_digests``

    def __init__(self, group: TrainGroup, algo) -> None:
        self.group, self.algo = group, algo

    def key(self, name: str) -> str:
        """The metric name of this role's figure ``name`` (the policy's figures are the step's own)."""
        return name

    def train_key(self, name: str) -> str:
        """The metric name of a training figure (the loss terms, sample counts, grad norm, time split)."""
        return self.key("loss") if name == "loss" else f"train/{name}"

    def pre_update(self, batch: RolloutBatch) -> RolloutBatch:
        """The role's pass over the batch before any update (every optimizer step of the rollout then sees the
        same old model); returns the batch with its columns attached."""
        return batch

    def targets(self, batch: RolloutBatch) -> Dict[str, float]:
        """What the role needs once the advantages are known, attached to the batch; returns its figures."""
        return {}

    def finish_metrics(self, metrics: Dict[str, float]) -> None:
        """Role-specific renames of the step's training figures, in place."""


class PolicyRole(Role):
    name = "actor"

    def pre_update(self, batch: RolloutBatch) -> RolloutBatch:
        # With one optimizer step per rollout the training forward computes the proximal log-probs itself.
        if old_logprobs_from_training(self.algo, batch.num_minibatches(self.algo.global_batch_size)):
            return batch
        return attach_replica_pass(self.group, batch)

    def finish_metrics(self, metrics: Dict[str, float]) -> None:
        # |proximal - behaviour| log-prob per token, weighed as the loss weighs tokens (policy_loss's diagnostic)
        metrics["rollout/logprob_abs_diff"] = metrics.pop("train/logprob_abs_diff", 0.0)


class CriticRole(Role):
    """PPO's value model: its pre-update pass attaches ``old_values``, it trains towards ``returns``."""

    name = "critic"
    event_role = "critic"
    ledger_prefix = "critic_"

    def key(self, name: str) -> str:
        return f"critic/{name}"

    def train_key(self, name: str) -> str:
        return self.key(name)

    def pre_update(self, batch: RolloutBatch) -> RolloutBatch:
        return attach_replica_pass(self.group, batch)

    def targets(self, batch: RolloutBatch) -> Dict[str, float]:
        batch.samples["returns"] = returns(batch.samples["advantage"], batch.samples["old_values"])
        return {self.key("explained_variance"): explained_variance(batch.samples["old_values"],
                                                                   batch.samples["returns"])}


def build_roles(algo, policy: TrainGroup, critic: Optional[TrainGroup] = None) -> List[Role]:
    """The step's roles in training order: the policy, and the critic where the estimator has one."""
    return [PolicyRole(policy, algo)] + ([CriticRole(critic, algo)] if critic is not None else [])


def attach_replica_pass(group: TrainGroup, batch: RolloutBatch) -> RolloutBatch:
    """The group's pre-update pass (the policy's log-probs, the critic's values) over strided shares of the batch,
    one per replica holding the trained state; each sample's values land in its own row."""
    parts = strided_partition(len(batch), len(group.state_holder_ids()))
    results = group.compute_logprobs(ray.put(batch), parts)
    for key in results[0]:
        column: List[Any] = [None] * len(batch)
        for indices, result in zip(parts, results):
            for i, values in zip(indices, result[key]):
                column[i] = values
        batch.samples[key] = column
    return batch
