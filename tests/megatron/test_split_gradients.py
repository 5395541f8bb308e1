"""The core exactness property: however a minibatch is split among replicas (and packed into micro-batches), the
sum of the replicas' gradients is the gradient of one pass over the whole minibatch.

One process, world size 1 (gloo on CPU): each "replica" is a forward_backward on its part with the grads zeroed
before, so the sum over parts is what the cross-replica all-reduce would compute.
"""

import random

import pytest
import torch
from random_rollouts import random_rollout

from rlfw.config.schema import AlgoConfig
from rlfw.data.batch import RolloutBatch, split_batch
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=16,
    max_seq_len=32,
)
NUM_SAMPLES = 13
# fp32 round-off of sums taken in another order (other packings, other splits); sample_mean gradients are O(1)
RTOL, ATOL = 1e-5, 5e-7


@pytest.fixture(scope="module")
def trainer(megatron_world):

    from rlfw.megatron.policy import PolicyTrainer

    algo = AlgoConfig(name="grpo", lr=1e-3, adam_beta2=0.999, clip_eps_high=0.28, max_tokens_per_microbatch=64)
    return PolicyTrainer(SHAPE, algo, tp=1, temperature=0.7, device=torch.device("cpu"), init_seed=0)


@pytest.fixture(scope="module")
def rollout(trainer):
    """13 samples of varied prompt/response lengths (at most 16 tokens), advantages, and the trainer's log-probs."""
    batch = random_rollout(SHAPE.vocab_size, NUM_SAMPLES, seed=0, max_prompt=6, max_response=10)
    batch.samples.update(trainer.logprobs(batch))
    return batch


def with_old_logprobs(batch: RolloutBatch, ratio: str) -> RolloutBatch:
    """``own``: old = current log-probs (ratio 1); ``perturbed``: shifted so ratios spread across the clip range."""
    out = batch.select(range(len(batch)))
    if ratio == "perturbed":
        rng = random.Random(1)
        out.samples["old_logprobs"] = [[v + rng.gauss(0.0, 0.3) for v in lp] for lp in out.samples["old_logprobs"]]
    return out


def grads(trainer, parts, loss_agg, max_tokens=64):
    """The sum over ``parts`` of each part's gradient (as one replica computes it), and the summed loss terms."""
    trainer.algo.loss_agg = loss_agg
    trainer.algo.max_tokens_per_microbatch = max_tokens
    total, stats = None, {}
    for part in parts:
        trainer.zero_grad()
        for key, value in trainer.forward_backward(part).items():
            stats[key] = stats.get(key, 0.0) + value
        g = [b.clone().double() for b in trainer.grad_buffers()]
        total = g if total is None else [t + x for t, x in zip(total, g)]
    return total, stats


def assert_same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.allclose(a, e, rtol=RTOL, atol=ATOL), (a - e).abs().max().item()


def test_logprobs_are_the_response_logprobs(trainer, rollout):
    lps = rollout.samples["old_logprobs"]
    assert [len(lp) for lp in lps] == rollout.response_lengths()
    assert all(v < 0 for lp in lps for v in lp)
    # packing does not change the numbers: one sample per micro-batch vs everything in one row
    trainer.algo.max_tokens_per_microbatch = 16
    one_by_one = trainer.logprobs(rollout)["old_logprobs"]
    trainer.algo.max_tokens_per_microbatch = 512
    packed = trainer.logprobs(rollout)["old_logprobs"]
    for a, b in zip(one_by_one, packed):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ratio", ["own", "perturbed"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])  # weights summing to one
def test_sum_of_split_gradients_equals_whole_gradient(trainer, rollout, loss_agg, ratio):
    (minibatch,) = with_old_logprobs(rollout, ratio).minibatches(0)
    whole, whole_stats = grads(trainer, [minibatch], loss_agg)
    assert sum(g.abs().sum().item() for g in whole) > 0  # a real gradient, not zeros
    if ratio == "perturbed":
        assert 0 < whole_stats["clip_frac"] < 1  # some tokens are clipped, some are not
    else:
        assert whole_stats["clip_frac"] == 0 and whole_stats["ratio"] == pytest.approx(1.0, rel=1e-5)

    for how in ("strided", "balanced"):
        for k in (1, 2, 3, 4):
            parts = split_batch(minibatch, k, how)
            assert sorted(i for p in parts for i in p.sample_ids) == list(range(NUM_SAMPLES))
            summed, stats = grads(trainer, parts, loss_agg)
            assert_same(summed, whole)
            for key in ("loss", "clip_frac", "ratio"):  # weighted sums: the parts add up to the global mean
                assert stats[key] == pytest.approx(whole_stats[key], rel=1e-5, abs=1e-7), (how, k, key)


@pytest.mark.parametrize("loss_agg", ["token_mean", "sample_mean", "seq_mean_token_mean"])
def test_more_replicas_than_samples(trainer, rollout, loss_agg):
    # 13 samples in minibatches of 5: the last one has 3 samples, so one of 4 replicas gets an empty part.
    minibatch = with_old_logprobs(rollout, "perturbed").minibatches(5)[-1]
    assert len(minibatch) == 3 and minibatch.meta["minibatch_index"] == 2
    whole, _ = grads(trainer, [minibatch], loss_agg)
    for how in ("strided", "balanced"):
        parts = split_batch(minibatch, 4, how)
        assert sorted(len(p) for p in parts) == [0, 1, 1, 1]
        # the empty part leaves zeros in the grad buffers (it still joins the all-reduce)
        trainer.zero_grad()
        assert trainer.forward_backward(next(p for p in parts if len(p) == 0)) == {}
        assert all((b == 0).all() for b in trainer.grad_buffers())
        summed, _ = grads(trainer, parts, loss_agg)
        assert_same(summed, whole)


@pytest.mark.parametrize("loss_agg", ["token_mean", "sample_mean", "seq_mean_token_mean"])
def test_microbatch_budget_does_not_change_the_gradient(trainer, rollout, loss_agg):
    (minibatch,) = with_old_logprobs(rollout, "perturbed").minibatches(0)
    small, small_stats = grads(trainer, [minibatch], loss_agg, max_tokens=32)
    large, large_stats = grads(trainer, [minibatch], loss_agg, max_tokens=512)
    assert_same(small, large)
    assert small_stats["loss"] == pytest.approx(large_stats["loss"], rel=1e-5)


def test_loss_aggregation_matters(trainer, rollout):
    # Guards the tests above against a loss that ignores its weights: the two aggregations differ.
    (minibatch,) = with_old_logprobs(rollout, "perturbed").minibatches(0)
    token, _ = grads(trainer, [minibatch], "token_mean")
    sample, _ = grads(trainer, [minibatch], "sample_mean")
    assert not all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(token, sample))


def test_a_share_is_normalised_by_the_whole_minibatch(trainer, rollout):
    """A replica's part carries the whole minibatch's denominators: with on-policy ratios (1) its token_mean loss is
    -sum of A over its own response tokens / every response token of the minibatch. Normalised by its own token
    count instead, it would be about twice that."""
    (minibatch,) = with_old_logprobs(rollout, "own").minibatches(0)
    part = split_batch(minibatch, 2, "strided")[0]
    _, stats = grads(trainer, [part], "token_mean")

    def advantage_tokens(batch):
        return sum(sum(a) if isinstance(a, (list, tuple)) else a * n
                   for a, n in zip(batch.samples["advantage"], batch.response_lengths()))

    total_tokens = sum(minibatch.response_lengths())
    assert sum(part.response_lengths()) < total_tokens
    assert stats["loss"] == pytest.approx(-advantage_tokens(part) / total_tokens, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("loss_agg", ["token_mean", "sample_mean"])
def test_old_logprobs_from_the_training_forward_equal_the_separate_pass(trainer, rollout, loss_agg):
    """``algo.old_logprobs=auto`` (one optimizer step per rollout): without the ``old_logprobs`` column the loss
    takes the training forward's own log-probs as the old policy's. That is the separate pass's result: the same
    loss terms and gradients, split among replicas or not."""
    (minibatch,) = with_old_logprobs(rollout, "own").minibatches(0)
    (without,) = rollout.select(range(len(rollout))).minibatches(0)
    del without.samples["old_logprobs"]
    expected, expected_stats = grads(trainer, [minibatch], loss_agg)
    for parts in ([without], split_batch(without, 3, "strided")):
        actual, stats = grads(trainer, parts, loss_agg)
        assert_same(actual, expected)
        for key in ("loss", "ratio", "clip_frac", "pg_loss"):
            assert stats[key] == pytest.approx(expected_stats[key], rel=1e-5, abs=1e-7), key
    # and the column is what decides: perturbed old log-probs give other gradients
    perturbed, _ = grads(trainer, [with_old_logprobs(rollout, "perturbed").minibatches(0)[0]], loss_agg)
    assert not all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(perturbed, expected))
