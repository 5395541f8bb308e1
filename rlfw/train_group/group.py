"""What the loop asks of a train group: one role's replicas, classic (``ClassicGroup``) or cells (``CellGroup``).

Both implementations return the same types, so the loop never asks which one it holds. Replicas are named by id
(a classic world's data-parallel rank, a cell's id); a role's replica ``i`` pairs with replica ``i`` of every other
role, and a cell's replacement keeps its id, so the pairing survives a heal.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol

import ray


class TrainGroup(Protocol):
    metric_prefix: str  # the per-replica metrics' prefix: ``<prefix>/<replica id>/num_samples``

    def replica_ids(self) -> List[int]:
        """The replicas the next train call goes to (the minibatches are split among them)."""

    def state_holder_ids(self) -> List[int]:
        """The replicas that hold the trained state: they compute the log-prob shares and write (a subset of
        ``replica_ids``: a cell's replacement takes part in training, and holds the state once it committed)."""

    def await_replacements(self) -> None:
        """Wait up to ft.await_replacement_s for replacements under way, so that they take part in the step."""

    def compute_logprobs(self, batch: ray.ObjectRef, parts: List[List[int]]) -> List[Dict[str, Any]]:
        """One result per share of ``parts`` (sample indices of ``batch``): the pre-update pass (``TrainerWorker.
        compute_logprobs``), whatever replica computed it."""

    def train(self, minibatches: Any) -> Dict[int, List[Dict[str, Any]]]:
        """Every replica runs the step protocol on ``minibatches``; per replica id that answered, the records of its
        committed optimizer steps (``rlfw.ft.protocol.train_call``)."""

    def export_weights(self) -> ray.ObjectRef:
        """The full weights in Hugging Face names, as a reference the rollout engines load from."""

    def save(self, path: str, step: int) -> None:
        """Write the trained state after ``step`` steps into ``path`` (a checkpoint's directory)."""

    def minibatches_committed(self, step: int) -> int:
        """How many of RL step ``step``'s minibatches are committed: what a save inside the step holds."""

    def weights_digests(self) -> Dict[int, str]:
        """Per replica holding the trained state, a SHA-256 over its weights: equal iff bitwise equal."""

    def restore(self, load_from: Optional[str]) -> None:
        """Start every replica afresh from the checkpoint ``load_from`` (None: the init weights)."""

    def step_info(self) -> Dict[str, float]:
        """The group's figures for the step's metrics (alive cells, quorum, failures); empty where it has none."""

    def drain_events(self) -> List[Dict[str, Any]]:
        """The group's events since the last drain (failures, joins, heals), each a dict with ``kind``."""

    def shutdown(self) -> None:
        """Stop every replica; the group is not used afterwards."""
