"""Loss aggregation over packed micro-batches: the three modes by hand, and the invariant the trainer relies on:
replicas train shares of one minibatch and SUM their gradients, so the per-part losses and gradients of any split,
packed under any token budget, add up to the whole minibatch's.

The policy is a bigram table (the logits at a position are a row of a parameter matrix picked by the token there):
small, exact, and differentiable, so the test sees the packing, weights and loss options and nothing else.
"""

import random

import pytest
import torch

from rlfw.algo.losses import LOSS_AGGREGATIONS, policy_loss
from rlfw.config.schema import AlgoConfig
from rlfw.data.batch import RolloutBatch, split_batch
from rlfw.megatron.packing import microbatches

torch.set_num_threads(1)

VOCAB = 12
EVERY_OPTION = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip_c": 3.0, "kl_loss_coef": 0.1, "tis_cap": 2.0,
                "entropy_coef": 0.01}


class Bigram:
    def __init__(self, seed: int):
        self.theta = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.theta[tokens]

    def logprobs(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits(tokens), dim=-1).gather(-1, labels[:, None])[:, 0]

    def response_logprobs(self, seq, prompt_len):
        lp = self.logprobs(torch.tensor(seq[:-1]), torch.tensor(seq[1:])).detach()
        return lp[prompt_len - 1:].tolist()  # position j predicts token j + 1


def loss_and_grad(policy: Bigram, part: RolloutBatch, algo: AlgoConfig, budget: int):
    """What one replica computes on its part: the summed micro-batch losses and the accumulated gradient."""
    policy.theta.grad = None
    total = 0.0
    for _, mb in microbatches(part, budget, algo.loss_agg):
        tokens, labels = mb.tokens[0], mb.labels[0]
        ref, rollout = (None if lp is None else lp[0] for lp in (mb.ref_logprobs, mb.rollout_logprobs))
        loss, _ = policy_loss(
            policy.logprobs(tokens, labels), mb.old_logprobs[0], mb.advantages[0], mb.loss_weight[0], algo,
            ref, rollout, torch.distributions.Categorical(logits=policy.logits(tokens)).entropy(),
        )
        loss.backward()
        total += loss.item()
    grad = policy.theta.grad if policy.theta.grad is not None else torch.zeros_like(policy.theta)
    return total, grad.clone()


def make_batch(policy: Bigram, num_samples: int, seed: int, per_token_advantage: bool) -> RolloutBatch:
    """Samples of varied prompt and response lengths; old log-probs near the policy's, so ratios spread across the
    clip range; per-sample or per-token advantages (the latter as with a KL penalty in the reward)."""
    rng = random.Random(seed)
    cols = {k: [] for k in ("sample_id", "tokens", "prompt_len", "advantage", "old_logprobs", "ref_logprobs",
                            "rollout_logprobs")}
    for i in range(num_samples):
        p, r = rng.randint(1, 5), rng.randint(1, 8)
        seq = [rng.randrange(VOCAB) for _ in range(p + r)]
        current = policy.response_logprobs(seq, p)
        cols["sample_id"].append(i)
        cols["tokens"].append(seq)
        cols["prompt_len"].append(p)
        cols["advantage"].append([rng.gauss(0, 1) for _ in range(r)] if per_token_advantage else rng.gauss(0, 1))
        cols["old_logprobs"].append([v + rng.gauss(0, 0.4) for v in current])
        cols["ref_logprobs"].append([v + rng.gauss(0, 0.3) for v in current])
        cols["rollout_logprobs"].append([v + rng.gauss(0, 0.3) for v in current])
    return RolloutBatch(cols, {"step": 0})


@pytest.mark.parametrize("per_token_advantage", [False, True], ids=["per_sample_adv", "per_token_adv"])
@pytest.mark.parametrize("loss_agg", LOSS_AGGREGATIONS)
def test_sum_over_any_split_and_packing_equals_the_whole(loss_agg, per_token_advantage):
    policy = Bigram(seed=0)
    algo = AlgoConfig(name="grpo", loss_agg=loss_agg, **EVERY_OPTION)
    (minibatch,) = make_batch(policy, 11, seed=1, per_token_advantage=per_token_advantage).minibatches(0)
    whole_loss, whole_grad = loss_and_grad(policy, minibatch, algo, budget=64)
    assert whole_grad.abs().sum() > 0
    for how in ("strided", "balanced"):
        for k in (1, 2, 3, 4):
            for budget in (13, 64):
                parts = [loss_and_grad(policy, p, algo, budget) for p in split_batch(minibatch, k, how)]
                assert sum(loss for loss, _ in parts) == pytest.approx(whole_loss, rel=1e-5, abs=1e-6)
                torch.testing.assert_close(sum(g for _, g in parts), whole_grad, rtol=1e-4, atol=1e-6)


def test_a_share_is_not_normalised_by_its_own_size():
    # Each part carries the whole minibatch's denominators: a part alone is a share of the loss, not a mean.
    policy = Bigram(seed=0)
    algo = AlgoConfig(name="grpo", loss_agg="seq_mean_token_mean")
    (minibatch,) = make_batch(policy, 8, seed=2, per_token_advantage=False).minibatches(0)
    whole, _ = loss_and_grad(policy, minibatch, algo, budget=64)
    first, second = (loss_and_grad(policy, p, algo, 64)[0] for p in split_batch(minibatch, 2, "strided"))
    assert first + second == pytest.approx(whole, rel=1e-5)
    assert first != pytest.approx(whole, rel=1e-2)


@pytest.mark.parametrize("loss_agg,expected", [
    # response lengths 2, 3, 1 with advantages -1, -2, -4; ratio 1, so each token's loss is -A: 1, 2, 4
    ("token_mean", (2 * 1 + 3 * 2 + 1 * 4) / 6),  # every token counts once: 12 / 6 = 2
    ("sample_mean", (2 * 1 + 3 * 2 + 1 * 4) / 3),  # the sum over a sample's tokens, mean over samples: 4
    ("seq_mean_token_mean", (1 + 2 + 4) / 3),  # the mean over a sample's tokens, mean over samples: 7/3
])
def test_the_three_aggregations_by_hand(loss_agg, expected):
    policy = Bigram(seed=3)
    seqs = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    prompt_lens = [2, 1, 1]
    batch = RolloutBatch({
        "sample_id": [0, 1, 2], "tokens": seqs, "prompt_len": prompt_lens, "advantage": [-1.0, -2.0, -4.0],
        "old_logprobs": [policy.response_logprobs(s, p) for s, p in zip(seqs, prompt_lens)],
    }, {"step": 0})
    (minibatch,) = batch.minibatches(0)
    assert minibatch.response_lengths() == [2, 3, 1]
    loss, _ = loss_and_grad(policy, minibatch, AlgoConfig(name="grpo", loss_agg=loss_agg), budget=64)
    assert loss == pytest.approx(expected, rel=1e-6)
