"""verify_agreement: replicas that describe the step differently are caught, with both values named."""

import pytest
import torch

from rlfw.data.batch import DYNAMIC_GBS, SAMPLE_IDS_DIGEST, RolloutBatch
from rlfw.ft.agreement import DisagreementError, agreement_vector, verify_agreement
from rlfw.ft.errors import FatalError

torch.set_num_threads(1)


def part(num_samples=8, num_tokens=40, minibatch_index=1, n_local=3, step=5, ids_digest=77):
    samples = {"sample_id": list(range(n_local)), "tokens": [[1, 2, 3]] * n_local, "prompt_len": [1] * n_local}
    meta = {DYNAMIC_GBS: {"num_samples": num_samples, "num_tokens": num_tokens}, "minibatch_index": minibatch_index,
            "step": step, SAMPLE_IDS_DIGEST: ids_digest}
    return RolloutBatch(samples, meta)


class FakeWorld:
    """Three replicas' agreement vectors in one process; allreduce(min|max) reduces over all of them.

    Every replica's vector is registered first, as a real collective would see them all.
    """

    def __init__(self, parts, num_participants, extras=None):
        extras = extras or [None] * len(parts)
        self.vectors = [agreement_vector(p, n, e) for p, n, e in zip(parts, num_participants, extras)]
        self.calls = []

    def allreduce(self, tensor, op):
        self.calls.append(op)
        assert any(torch.equal(tensor, v) for v in self.vectors), "a replica must send its own vector"
        stacked = torch.stack(self.vectors)
        return {"min": stacked.min(dim=0).values, "max": stacked.max(dim=0).values}[op]


def run_all(parts, num_participants=(3, 3, 3), extras=None):
    world = FakeWorld(parts, num_participants, extras)
    errors = []
    for i, (p, n) in enumerate(zip(parts, num_participants)):
        try:
            verify_agreement(p, n, world.allreduce, extras[i] if extras else None)
            errors.append(None)
        except DisagreementError as e:
            errors.append(str(e))
    return world, errors


def test_vector_layout():
    v = agreement_vector(part(8, 40, 1), 3)
    assert v.dtype == torch.float64
    assert v.tolist() == [5, 1, 77, 8, 40, 3]
    assert agreement_vector(part(), 3, {"ft_step": 4, "quorum_id": 9}).tolist()[-2:] == [4, 9]


def test_equal_replicas_pass():
    # local share sizes differ (that is normal); the step description is what must agree
    world, errors = run_all([part(n_local=3), part(n_local=3), part(n_local=2)])
    assert errors == [None, None, None]
    assert sorted(world.calls) == ["max"] * 3 + ["min"] * 3


def test_one_replica_with_a_different_token_count_fails_everywhere():
    _, errors = run_all([part(num_tokens=40), part(num_tokens=41), part(num_tokens=40)])
    assert all(e is not None for e in errors)  # every replica discards the step, not just the odd one
    for e in errors:
        assert "num_tokens: 40 vs 41" in e
        assert "num_samples" not in e and "minibatch_index" not in e
    assert "[5.0, 1.0, 77.0, 8.0, 41.0, 3.0]" in errors[1]  # each names its own vector


@pytest.mark.parametrize(
    "kwargs,participants,expected",
    [
        ({"num_samples": 9}, (3, 3, 3), "num_samples: 8 vs 9"),
        ({"minibatch_index": 0}, (3, 3, 3), "minibatch_index: 0 vs 1"),
        ({}, (3, 2, 3), "num_participants: 2 vs 3"),
        ({"step": 4}, (3, 3, 3), "step: 4 vs 5"),
        ({"ids_digest": 78}, (3, 3, 3), "sample_ids: 77 vs 78"),
    ],
)
def test_each_field_is_checked(kwargs, participants, expected):
    _, errors = run_all([part(), part(**kwargs), part()], participants)
    assert all(e is not None and expected in e for e in errors)


def test_the_syncs_own_fields_are_checked_by_name():
    extras = [{"ft_step": 4, "quorum_id": 9}, {"ft_step": 3, "quorum_id": 9}, {"ft_step": 4, "quorum_id": 9}]
    _, errors = run_all([part(), part(), part()], extras=extras)
    assert all(e is not None and "ft_step: 3 vs 4" in e and "quorum_id" not in e for e in errors)


def test_a_minibatchs_digest_names_its_sample_ids_in_order():
    [a] = RolloutBatch({"sample_id": [3, 1, 2], "tokens": [[1]] * 3, "prompt_len": [0] * 3}).minibatches(0)
    [b] = RolloutBatch({"sample_id": [3, 1, 4], "tokens": [[1]] * 3, "prompt_len": [0] * 3}).minibatches(0)
    assert a.meta[SAMPLE_IDS_DIGEST] != b.meta[SAMPLE_IDS_DIGEST]
    assert 0 < a.meta[SAMPLE_IDS_DIGEST] < 2 ** 53  # exact in the float64 agreement vector
    assert a.select([0, 1]).meta[SAMPLE_IDS_DIGEST] == a.meta[SAMPLE_IDS_DIGEST]  # a share keeps its minibatch's


def test_several_differences_are_all_named():
    _, errors = run_all([part(num_samples=8, num_tokens=40), part(num_samples=7, num_tokens=44), part()])
    assert "num_samples: 7 vs 8" in errors[0] and "num_tokens: 40 vs 44" in errors[0]


def test_missing_minibatch_index_counts_as_zero():
    no_index = part(minibatch_index=0)
    del no_index.meta["minibatch_index"]
    _, errors = run_all([part(minibatch_index=0), no_index, part(minibatch_index=0)])
    assert errors == [None, None, None]


def test_disagreement_is_fatal():
    # The driver stops the run on a FatalError instead of trying to heal.
    assert issubclass(DisagreementError, FatalError)


def test_allreduce_cannot_corrupt_the_callers_vector():
    # verify_agreement must hand the collective copies: an in-place MIN must not feed the MAX.
    p = part(num_tokens=40)
    other = agreement_vector(part(num_tokens=41), 3)

    def in_place(tensor, op):
        reduce = torch.minimum if op == "min" else torch.maximum
        tensor.copy_(reduce(tensor, other))
        return tensor

    with pytest.raises(DisagreementError, match="num_tokens: 40 vs 41"):
        verify_agreement(p, 3, in_place)


def test_the_vectors_are_reduced_on_the_transports_device():
    """An NCCL group has no CPU backend: the collective gets the vectors on the device it is given (here meta, the
    one device besides the CPU that every machine has), and the verdict comes back on the host."""
    seen = []

    def on_meta(tensor, op):
        seen.append(tensor.device.type)
        return torch.zeros(tensor.shape, dtype=tensor.dtype)  # every replica reported zeros: they agree

    verify_agreement(part(), 1, on_meta, device=torch.device("meta"))
    assert seen == ["meta", "meta"]
