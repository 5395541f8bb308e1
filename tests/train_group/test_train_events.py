"""What a train call's records report: a step redone on a fresh split, a heal, each change of quorum, once."""

from rlfw.train_group.train_events import train_events


def record(mb, quorum, attempts=1, replicas=2, heal_time=None):
    return {"minibatch_index": mb, "quorum_id": quorum, "attempts": attempts, "num_replicas": replicas,
            "heal_time": heal_time}


def test_resplits_heals_and_quorum_changes():
    results = {0: [record(0, 7, attempts=2, replicas=1), record(1, 8, replicas=2)],
               2: [record(1, 8, heal_time=1.5)]}  # cell 2 joined at minibatch 1 and healed there
    assert train_events(results, quorum_id=6) == [
        {"kind": "resplit", "minibatch": 0, "attempts": 2, "participants": 1},
        {"kind": "quorum_change", "old": 6, "new": 7, "participants": 1},
        {"kind": "quorum_change", "old": 7, "new": 8, "participants": 2},
        {"kind": "heal", "cell": 2, "heal_time": 1.5, "quorum_id": 8},
    ]
    assert train_events({0: [record(0, 8)]}, quorum_id=8) == []  # a quiet step reports nothing
