"""Packing samples into micro-batches: bins, the packed row's offsets/mask/positions/labels/weights, global loss
weights, and the copy to a device."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch, split_batch
from rlfw.megatron.packing import (
    block_causal_mask,
    build_microbatch,
    build_rows,
    microbatches,
    pack_by_token_budget,
    token_weights,
)

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------ pack_by_token_budget
def check_bins(bins, lengths, budget):
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every index exactly once
    for b in bins:
        assert b, "no empty bins"
        assert b == sorted(b)
        assert sum(lengths[i] for i in b) <= budget


def test_first_fit_decreasing_by_hand():
    # sorted by length: 5(i0) 4(i1) 3(i2) 3(i3) 2(i4) 1(i5); budget 8
    # 5 -> bin0 (3 left); 4 -> bin1 (4 left); 3 -> bin0 (0 left); 3 -> bin1 (1 left); 2 -> bin2; 1 -> bin1
    assert pack_by_token_budget([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]


def test_exact_fit_and_empty():
    assert pack_by_token_budget([8, 8], 8) == [[0], [1]]
    assert pack_by_token_budget([3, 5], 8) == [[0, 1]]
    assert pack_by_token_budget([], 8) == []


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), max_size=40), st.integers(min_value=40, max_value=120))
def test_bins_cover_every_index_once_within_budget(lengths, budget):
    bins = pack_by_token_budget(lengths, budget)
    check_bins(bins, lengths, budget)
    assert pack_by_token_budget(list(lengths), budget) == bins  # deterministic
    # first fit never leaves two bins that would fit together
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    if len(loads) > 1:
        assert loads[0] + loads[1] > budget


def test_over_budget_sample_raises_naming_lengths():
    with pytest.raises(ValueError, match=r"sample of 9 tokens exceeds the micro-batch budget of 8 tokens"):
        pack_by_token_budget([3, 9, 2], 8)


# ---------------------------------------------------------------------------------------------- build_microbatch
def make_batch():
    samples = {
        "sample_id": [10, 11, 12],
        "tokens": [[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12]],
        "prompt_len": [3, 1, 2],  # responses: [4, 5], [7, 8, 9], [12]
        "advantage": [0.5, -1.5, 2.0],
        "old_logprobs": [[-0.1, -0.2], [-0.3, -0.4, -0.5], [-0.6]],
        "ref_logprobs": [[-1.1, -1.2], [-1.3, -1.4, -1.5], [-1.6]],
    }
    return RolloutBatch(samples, {DYNAMIC_GBS: {"num_samples": 3, "num_tokens": 6}})


ORDER = [1, 2, 0]  # packing order differs from batch order
WEIGHTS = [0.25, 0.125, 0.0625]  # per batch index


@pytest.fixture
def mb():
    return build_microbatch(make_batch(), ORDER, WEIGHTS, dense_mask=True)


def spans():
    """(batch index, start, length) of each sequence in the packed row."""
    batch, out, offset = make_batch(), [], 0
    for i in ORDER:
        n = len(batch.samples["tokens"][i])
        out.append((i, offset, n))
        offset += n
    return out


def test_shapes_and_tokens(mb):
    batch = make_batch()
    T = 12
    assert mb.tokens.shape == mb.position_ids.shape == mb.labels.shape == mb.loss_weight.shape == (1, T)
    assert mb.attention_mask.shape == (1, 1, T, T) and mb.attention_mask.dtype == torch.bool
    assert mb.tokens[0].tolist() == [t for i in ORDER for t in batch.samples["tokens"][i]]


def test_sequence_offsets_by_hand(mb):
    # ORDER packs lengths 4, 3, 5: sequences start at 0, 4, 7; the row ends at 12
    assert mb.cu_seqlens.tolist() == [0, 4, 7, 12] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 5


def test_no_dense_mask_unless_asked():
    mb = build_microbatch(make_batch(), ORDER, WEIGHTS)
    assert mb.attention_mask is None
    assert mb.cu_seqlens.tolist() == [0, 4, 7, 12]


def test_mask_is_block_diagonal_causal(mb):
    masked = mb.attention_mask[0, 0]
    seq_of = {}
    for s, (_, start, n) in enumerate(spans()):
        for pos in range(start, start + n):
            seq_of[pos] = s
    for q in range(12):
        for k in range(12):
            allowed = seq_of[q] == seq_of[k] and k <= q
            assert bool(masked[q, k]) == (not allowed), (q, k)
    # a token never attends to another sequence, and always to itself
    assert not masked.diagonal().any()
    assert torch.equal(mb.attention_mask, block_causal_mask(torch.tensor([4, 3, 5])))


def test_position_ids_restart_per_sequence(mb):
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]


def test_labels_are_next_tokens_within_each_sequence(mb):
    batch = make_batch()
    labels = mb.labels[0].tolist()
    for i, start, n in spans():
        seq = batch.samples["tokens"][i]
        assert labels[start:start + n - 1] == seq[1:]
        assert labels[start + n - 1] == 0  # the last token predicts nothing (never the next sequence's first)


def test_loss_weight_only_on_positions_predicting_response_tokens(mb):
    batch = make_batch()
    weight, labels = mb.loss_weight[0].tolist(), mb.labels[0].tolist()
    expected = [0.0] * 12
    for i, start, n in spans():
        p = batch.samples["prompt_len"][i]
        for j in range(p - 1, n - 1):  # position j predicts token j + 1, a response token
            expected[start + j] = WEIGHTS[i]
        # the weighted positions' labels are exactly this sample's response
        assert [labels[start + j] for j in range(n) if weight[start + j] > 0] == batch.samples["tokens"][i][p:]
    assert weight == expected
    # response slices: the weighted positions of each sample, in packing order
    assert [(s.start, s.stop) for s in mb.response_slices] == [(0, 3), (5, 6), (9, 11)]


def test_per_token_advantages_and_logprobs_aligned(mb):
    batch = make_batch()
    for (i, start, n), sl in zip(spans(), mb.response_slices):
        assert mb.advantages[0, start:start + n].tolist() == [batch.samples["advantage"][i]] * n
        torch.testing.assert_close(mb.old_logprobs[0, sl], torch.tensor(batch.samples["old_logprobs"][i]))
        torch.testing.assert_close(mb.ref_logprobs[0, sl], torch.tensor(batch.samples["ref_logprobs"][i]))
    outside = mb.loss_weight[0] == 0
    assert (mb.old_logprobs[0][outside] == 0).all() and (mb.ref_logprobs[0][outside] == 0).all()


def test_forward_only_microbatch_has_no_weights_nor_optional_columns():
    batch = make_batch()
    plain = RolloutBatch({k: batch.samples[k] for k in ("sample_id", "tokens", "prompt_len")}, batch.meta)
    mb = build_microbatch(plain, [0, 1], None)
    assert (mb.loss_weight == 0).all()
    assert mb.old_logprobs is None and mb.ref_logprobs is None
    assert (mb.advantages == 0).all()
    assert [(s.start, s.stop) for s in mb.response_slices] == [(2, 4), (5, 8)]


# ------------------------------------------------------------------------------------------------ token_weights
def random_batch(n, seed):
    rng = random.Random(seed)
    samples = {"sample_id": [], "tokens": [], "prompt_len": [], "advantage": []}
    for i in range(n):
        p, r = rng.randint(1, 6), rng.randint(1, 12)
        samples["sample_id"].append(i)
        samples["tokens"].append([rng.randrange(16) for _ in range(p + r)])
        samples["prompt_len"].append(p)
        samples["advantage"].append(rng.gauss(0, 1))
    return RolloutBatch(samples, {"step": 0})


@pytest.mark.parametrize("how", ["strided", "balanced"])
@pytest.mark.parametrize("num_parts", [1, 2, 3])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_weights_over_all_parts_sum_to_one(loss_agg, num_parts, how):
    whole = random_batch(11, seed=1)
    for mb in whole.minibatches(4):  # 4, 4, 3 samples: every minibatch normalises on its own
        total_from_weights = 0.0
        total_from_rows = 0.0
        for part in split_batch(mb, num_parts, how):
            if len(part) == 0:
                continue
            w = token_weights(part, loss_agg)
            total_from_weights += sum(wi * r for wi, r in zip(w, part.response_lengths()))
            for _, micro in microbatches(part, 24, loss_agg):
                total_from_rows += micro.loss_weight.double().sum().item()
        assert total_from_weights == pytest.approx(1.0, abs=1e-12)
        assert total_from_rows == pytest.approx(1.0, abs=1e-6)


def test_token_and_sample_mean_weights_by_hand():
    batch = make_batch()  # response lengths 2, 3, 1; global: 3 samples, 6 tokens
    part = batch.select([0, 2])  # a replica's share: the denominators stay global
    assert part.meta[DYNAMIC_GBS] == {"num_samples": 3, "num_tokens": 6}
    assert token_weights(part, "token_mean") == pytest.approx([1 / 6, 1 / 6])
    assert token_weights(part, "sample_mean") == pytest.approx([1 / 3, 1 / 3])
    assert token_weights(part, "seq_mean_token_mean") == pytest.approx([1 / (2 * 3), 1 / (1 * 3)])
    with pytest.raises(ValueError, match="loss aggregation"):
        token_weights(part, "seq_mean_token_sum")



def test_rows_are_built_lazily_and_match_microbatches():
    batch = random_batch(9, seed=3)
    batch.meta[DYNAMIC_GBS] = {"num_samples": 9, "num_tokens": batch.num_response_tokens()}
    bins = pack_by_token_budget([len(t) for t in batch.samples["tokens"]], 24)
    rows = build_rows(batch, bins, "token_mean")
    assert not isinstance(rows, list)  # a generator: nothing is built before it is consumed
    eager = microbatches(batch, 24, "token_mean")
    assert [indices for indices, _ in eager] == bins
    for row, (_, expected) in zip(rows, eager, strict=True):
        for key, value in expected.__dict__.items():
            got = getattr(row, key)
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key


@pytest.mark.parametrize("non_blocking", [False, True])
def test_to_device_keeps_every_field(mb, non_blocking):
    moved = mb.to("cpu", non_blocking=non_blocking)
    for key, value in mb.__dict__.items():
        got = getattr(moved, key)
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key
