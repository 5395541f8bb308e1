"""RolloutBatch splits lose nothing: every per-sample key and value, every per-batch key, every sample once.

Also the dynamic global batch size of minibatches, and the driver's exactly-once sample accounting.
"""

import copy
import random

import pytest
import torch

from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch, split_batch
from rlfw.loop.ledger import check_exactly_once, trained_sample_ids

torch.set_num_threads(1)

# Every per-sample key the system puts on a batch: the rollout manager's columns, the advantage, the trainer's
# log-probs (attach_logprobs), and the reference log-probs when a KL term is on.
PER_SAMPLE_KEYS = (
    "sample_id", "group_id", "tokens", "prompt_len", "reward", "rollout_logprobs", "truncated", "advantage",
    "old_logprobs", "ref_logprobs",
)
HOWS = ("strided", "balanced")


def full_batch(n: int, seed: int = 0, first_id: int = 100) -> RolloutBatch:
    rng = random.Random(seed)
    cols = {k: [] for k in PER_SAMPLE_KEYS}
    for i in range(n):
        p, r = rng.randint(1, 8), rng.randint(1, 30)
        cols["sample_id"].append(first_id + i)
        cols["group_id"].append(i // 4)
        cols["tokens"].append([rng.randrange(50) for _ in range(p + r)])
        cols["prompt_len"].append(p)
        cols["reward"].append(rng.random())
        cols["rollout_logprobs"].append([-rng.random() for _ in range(r)])
        cols["truncated"].append(rng.random() < 0.3)
        cols["advantage"].append(rng.gauss(0, 1))
        cols["old_logprobs"].append([-rng.random() for _ in range(r)])
        cols["ref_logprobs"].append([-rng.random() for _ in range(r)])
    meta = {
        "step": 7,
        DYNAMIC_GBS: {"num_samples": 123, "num_tokens": 4567},
        "minibatch_index": 2,
        "raw_rewards": [0.1, 0.2, 0.3],
        "note": "per-batch",
    }
    return RolloutBatch(cols, meta)


def rows_by_id(batch: RolloutBatch):
    return {sid: {k: batch.samples[k][j] for k in batch.samples} for j, sid in enumerate(batch.sample_ids)}


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("num_parts", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 13])
def test_key_walk(n, num_parts, how):
    batch = full_batch(n, seed=n)
    original = copy.deepcopy(batch)
    parts = split_batch(batch, num_parts, how)

    assert len(parts) == num_parts
    # per-sample keys: all present, columns of one length
    for part in parts:
        assert set(part.samples) == set(PER_SAMPLE_KEYS)
        assert {len(col) for col in part.samples.values()} == {len(part)}
    # every sample exactly once, every value intact
    ids = [sid for part in parts for sid in part.sample_ids]
    assert sorted(ids) == sorted(original.sample_ids)
    want = rows_by_id(original)
    for part in parts:
        for sid, row in rows_by_id(part).items():
            assert row == want[sid], sid
    # per-batch keys reach every part unchanged
    for part in parts:
        assert part.meta == original.meta
    # part sizes within one (the replicas' micro-batch counts stay aligned); empty parts only when k > n
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    # the split does not modify its input
    assert batch.samples == original.samples and batch.meta == original.meta


@pytest.mark.parametrize("how", HOWS)
def test_parts_are_independent_of_each_other(how):
    batch = full_batch(6)
    parts = split_batch(batch, 3, how)
    parts[0].samples["advantage"][0] = 1e9
    parts[0].meta["step"] = -1
    assert 1e9 not in batch.samples["advantage"] and 1e9 not in parts[1].samples["advantage"]
    assert batch.meta["step"] == 7 and parts[1].meta["step"] == 7


def test_balanced_split_evens_out_workload():
    # One very long and many short sequences: strided puts both long ones in one part.
    cols = {"sample_id": list(range(8)), "tokens": [[1] * n for n in (200, 10, 10, 10, 190, 10, 10, 10)],
            "prompt_len": [1] * 8}
    batch = RolloutBatch(cols)
    loads = {how: sorted(sum(len(t) for t in p.samples["tokens"]) for p in split_batch(batch, 2, how))
             for how in HOWS}
    assert loads["strided"] == [40, 410]
    assert loads["balanced"] == [220, 230]


def test_unknown_split_policy_raises():
    with pytest.raises(ValueError, match="unknown partition method"):
        split_batch(full_batch(3), 2, "random")


# -------------------------------------------------------------------------------------------------- minibatches
@pytest.mark.parametrize("gbs", [3, 4, 5, 13, 20])
def test_minibatches_carry_their_own_dynamic_global_batch_size(gbs):
    batch = full_batch(13, seed=3)
    del batch.meta[DYNAMIC_GBS], batch.meta["minibatch_index"]
    original = copy.deepcopy(batch)
    mbs = batch.minibatches(gbs)

    sizes = [len(mb) for mb in mbs]
    assert sizes == [min(gbs, 13 - s) for s in range(0, 13, gbs)]
    assert batch.num_minibatches(gbs) == len(mbs)
    assert [sid for mb in mbs for sid in mb.sample_ids] == original.sample_ids  # consecutive, in order
    for index, mb in enumerate(mbs):
        assert mb.meta[DYNAMIC_GBS] == {"num_samples": len(mb), "num_tokens": sum(mb.response_lengths())}
        assert mb.meta["minibatch_index"] == index
        assert mb.meta["step"] == 7 and mb.meta["raw_rewards"] == [0.1, 0.2, 0.3]
        # every replica's share carries the whole minibatch's denominators, not its own counts
        for how in HOWS:
            for part in split_batch(mb, 3, how):
                assert part.meta[DYNAMIC_GBS] == mb.meta[DYNAMIC_GBS]
                assert part.meta["minibatch_index"] == index
    assert sum(mb.meta[DYNAMIC_GBS]["num_tokens"] for mb in mbs) == original.num_response_tokens()
    assert batch.meta == original.meta  # the rollout batch itself is not stamped


def test_minibatches_zero_means_one_step_on_everything():
    batch = full_batch(9)
    (mb,) = batch.minibatches(0)
    assert batch.num_minibatches(0) == 1 and batch.select([]).num_minibatches(0) == 0
    assert mb.sample_ids == batch.sample_ids
    assert mb.meta[DYNAMIC_GBS] == {"num_samples": 9, "num_tokens": batch.num_response_tokens()}
    assert mb.meta["minibatch_index"] == 0


def test_response_lengths():
    batch = RolloutBatch({"sample_id": [0, 1], "tokens": [[1, 2, 3, 4], [5, 6]], "prompt_len": [1, 2]})
    assert batch.response_lengths() == [3, 0]
    assert batch.num_response_tokens() == 3


def test_ragged_columns_raise():
    with pytest.raises(ValueError, match="differ in length"):
        RolloutBatch({"sample_id": [0, 1, 2], "tokens": [[1], [2]], "prompt_len": [1, 1, 1]})


def test_select_keeps_order_and_meta():
    batch = full_batch(5)
    sub = batch.select([4, 1])
    assert sub.sample_ids == [104, 101]
    assert sub.samples["tokens"] == [batch.samples["tokens"][4], batch.samples["tokens"][1]]
    assert sub.meta == batch.meta and sub.meta is not batch.meta


# ------------------------------------------------------------------------------------ exactly-once accounting
def step(mb, ids, participants=None):
    return {"minibatch_index": mb, "sample_ids": ids, "participant_ids": participants}


def accounting_batch():
    return RolloutBatch({"sample_id": list(range(12)), "tokens": [[1, 2]] * 12, "prompt_len": [1] * 12})


def test_dead_replicas_share_is_recovered_from_a_survivors_participant_ids():
    # Minibatch 0 (ids 0..5) was committed by replicas 0, 1, 2; replica 2 died afterwards and reports nothing.
    # Minibatch 1 (ids 6..11) was then trained by the two survivors.
    mb0 = [[0, 3], [1, 4], [2, 5]]
    results = {
        0: [step(0, [0, 3], mb0), step(1, [6, 8, 10], [[6, 8, 10], [7, 9, 11]])],
        1: [step(0, [1, 4], mb0), step(1, [7, 9, 11], [[6, 8, 10], [7, 9, 11]])],
    }
    trained = trained_sample_ids(results)
    assert sorted(trained) == list(range(12))
    check_exactly_once(accounting_batch(), trained)


def test_without_participant_ids_each_replica_reports_its_own_share():
    results = {r: [step(0, list(range(r, 12, 3)))] for r in range(3)}
    trained = trained_sample_ids(results)
    assert sorted(trained) == list(range(12))
    check_exactly_once(accounting_batch(), trained)


def test_lost_share_without_participant_ids_is_reported_missing():
    results = {r: [step(0, list(range(r, 12, 3)))] for r in range(2)}  # replica 2 died, no one knows its share
    with pytest.raises(RuntimeError, match="4 samples never trained, 0 trained more than once"):
        check_exactly_once(accounting_batch(), trained_sample_ids(results))


def test_missing_and_duplicated_ids_raise():
    batch = accounting_batch()
    with pytest.raises(RuntimeError, match="1 samples never trained, 0 trained more than once"):
        check_exactly_once(batch, list(range(11)))
    with pytest.raises(RuntimeError, match="0 samples never trained, 1 trained more than once"):
        check_exactly_once(batch, list(range(12)) + [5])
    with pytest.raises(RuntimeError, match="1 samples never trained, 1 trained more than once"):
        check_exactly_once(batch, [i for i in range(12) if i != 3] + [4])
    with pytest.raises(RuntimeError, match="sample accounting failed"):
        check_exactly_once(batch, list(range(12)) + [99])  # an id that is not in the batch
    check_exactly_once(batch, list(reversed(range(12))))  # order does not matter


def test_a_minibatch_trained_twice_is_caught():
    # The same minibatch reported under two indices (e.g. a retried step counted twice) duplicates its ids.
    results = {0: [step(0, [0, 1, 2, 3, 4, 5]), step(1, [0, 1, 2, 3, 4, 5])]}
    with pytest.raises(RuntimeError, match="trained more than once"):
        check_exactly_once(accounting_batch().select(range(6)), trained_sample_ids(results))


def test_survivors_disagreeing_on_participant_shares_raise():
    # Replica 1 saw a different minibatch 0 (sample 4 instead of 3): the ledger cannot say what was trained.
    results = {
        0: [step(0, [0, 2], [[0, 2], [1, 3]])],
        1: [step(0, [1, 4], [[0, 2], [1, 4]])],
    }
    with pytest.raises(RuntimeError, match="different participant shares for minibatch 0"):
        trained_sample_ids(results)


def test_one_minibatch_committed_by_two_quorums_is_a_fork():
    """Two replicas that each committed minibatch 0, in different quorums (a stalled cell that trained on alone):
    their weights diverged, whatever the sample ids say."""
    results = {
        0: [dict(step(0, [0, 2, 4], [[0, 2, 4]]), quorum_id=3, ft_step=7, num_replicas=1)],
        1: [dict(step(0, [1, 3, 5], [[1, 3, 5]]), quorum_id=4, ft_step=7, num_replicas=1)],
    }
    with pytest.raises(RuntimeError, match=r"minibatch 0 was committed twice: .*\(3, 7, 1\) vs \(4, 7, 1\)"):
        trained_sample_ids(results)
    results[1][0].update(quorum_id=3, participant_ids=[[0, 2, 4]], sample_ids=[0, 2, 4])
    trained_sample_ids(results)  # the same commit reported twice is fine
