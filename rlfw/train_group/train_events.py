"""What a train call's records say happened in it, as the group's events: steps redone, heals, quorum changes.

Every committed record carries its attempts, the quorum it committed in and, for a cell that healed in it, how
long the heal took (``rlfw.ft.protocol.train_call``); the loop logs these events beside the step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def train_events(results: Dict[int, List[Dict[str, Any]]], quorum_id: Optional[int]) -> List[Dict[str, Any]]:
    """``results``: cell id -> its committed records; ``quorum_id``: the quorum of the group's last commit."""
    events = []
    retried: Dict[int, Dict[str, Any]] = {}
    for steps in results.values():
        for s in steps:
            if s["attempts"] > 1 and s["attempts"] > retried.get(s["minibatch_index"], {}).get("attempts", 0):
                retried[s["minibatch_index"]] = s
    for mb, s in sorted(retried.items()):  # a discarded step redone on a fresh split of the same data
        events.append({"kind": "resplit", "minibatch": mb, "attempts": s["attempts"],
                       "participants": s["num_replicas"]})
    for cell_id, steps in results.items():
        for s in steps:
            if s.get("heal_time") is not None:
                events.append({"kind": "heal", "cell": cell_id, "heal_time": s["heal_time"],
                               "quorum_id": s["quorum_id"]})
            if quorum_id != s["quorum_id"]:
                events.append({"kind": "quorum_change", "old": quorum_id, "new": s["quorum_id"],
                               "participants": s["num_replicas"]})
                quorum_id = s["quorum_id"]
    return events
