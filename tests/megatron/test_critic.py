"""The PPO critic: the clipped value loss against hand-computed values, and the Megatron value model (values at
the right positions, split-invariant gradients, initialisation from the policy's weights)."""

import random

import pytest
import torch

from rlfw.config.schema import AlgoConfig, CriticConfig
from rlfw.data.batch import RolloutBatch, split_batch
from rlfw.megatron.critic import value_loss
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=16,
    max_seq_len=32,
)
ALGO = AlgoConfig(name="ppo", gamma=1.0, gae_lambda=0.95, max_tokens_per_microbatch=40)


def test_value_loss_matches_hand_computed_values():
    values = torch.tensor([[1.0, 2.0, float("nan")]])
    old_values = torch.tensor([[0.5, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, float("inf")]])
    weights = torch.tensor([[0.5, 0.5, 0.0]])  # the last token carries no loss: its NaN/inf inputs are ignored
    # Token 0: (1 - 2)^2 = 1, clipped V = 0.5 + 0.2 = 0.7 -> (0.7 - 2)^2 = 1.69 (larger: clipped). Token 1: 4, 4.
    loss, stats = value_loss(values, old_values, returns, weights, value_clip=0.2)
    assert float(loss) == pytest.approx(0.5 * (0.5 * 1.69 + 0.5 * 4.0))
    assert float(stats["value_clip_frac"]) == pytest.approx(0.5)
    assert int(stats["nonfinite_loss"]) == 0
    unclipped, stats = value_loss(values, old_values, returns, weights, value_clip=0.0)
    assert float(unclipped) == pytest.approx(0.5 * (0.5 * 1.0 + 0.5 * 4.0))
    assert float(stats["value_clip_frac"]) == 0.0


def test_value_loss_gradient_is_zero_where_the_clipped_term_wins():
    values = torch.tensor([[1.0, 2.1]], requires_grad=True)
    loss, _ = value_loss(values, torch.tensor([[0.5, 2.0]]), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2), 0.2)
    loss.backward()
    # Token 0: the clipped value (constant in V outside the range) wins -> no gradient; token 1: V - R = 2.1.
    assert values.grad.tolist() == [[0.0, pytest.approx(2.1)]]


@pytest.fixture(scope="module")
def critic(megatron_world):
    from rlfw.megatron.critic import ValueTrainer

    return ValueTrainer(SHAPE, ALGO, CriticConfig(lr=1e-3, value_clip=0.2), tp=1, device=torch.device("cpu"),
                        init_seed=0)


@pytest.fixture(scope="module")
def rollout(critic):
    rng = random.Random(0)
    cols = {k: [] for k in ("sample_id", "group_id", "tokens", "prompt_len", "reward")}
    for i in range(9):
        p, r = rng.randint(1, 6), rng.randint(1, 10)
        cols["sample_id"].append(i)
        cols["group_id"].append(i)
        cols["tokens"].append([rng.randrange(SHAPE.vocab_size) for _ in range(p + r)])
        cols["prompt_len"].append(p)
        cols["reward"].append(float(rng.random()))
    batch = RolloutBatch(cols, {"step": 0})
    batch.samples.update(critic.values(batch))
    # Old values shifted so some tokens fall outside the clip range; returns anywhere.
    batch.samples["old_values"] = [[v + rng.gauss(0, 0.3) for v in vs] for vs in batch.samples["old_values"]]
    batch.samples["returns"] = [[rng.gauss(0, 1) for _ in vs] for vs in batch.samples["old_values"]]
    return batch.minibatches(0)[0]


def test_values_are_per_response_token_and_do_not_depend_on_packing(critic, rollout):
    packed = critic.values(rollout)["old_values"]
    assert [len(v) for v in packed] == rollout.response_lengths()
    for i in range(len(rollout)):
        alone = critic.values(rollout.select([i]))["old_values"][0]
        assert alone == pytest.approx(packed[i], abs=1e-5)


def test_gradient_does_not_depend_on_the_split(critic, rollout):
    def grads(parts):
        critic.zero_grad()
        total = {}
        for part in parts:
            sums = critic.forward_backward(part)
            for k, v in sums.items():
                total[k] = total.get(k, 0.0) + v
        return torch.cat([g.clone() for g in critic.grad_buffers()]), total

    whole, sums_whole = grads([rollout])
    split, sums_split = grads(split_batch(rollout, 3, "strided"))
    assert whole.abs().sum() > 0
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)
    assert sums_split["loss"] == pytest.approx(sums_whole["loss"], rel=1e-5)
    assert 0 < sums_whole["value_clip_frac"] < 1
    assert critic.optimizer_step() is not None
    critic.zero_grad()


def test_init_from_policy_copies_the_trunk(megatron_world):
    from rlfw.megatron.critic import ValueTrainer
    from rlfw.megatron.policy import PolicyTrainer

    policy = PolicyTrainer(SHAPE, ALGO, tp=1, temperature=1.0, device=torch.device("cpu"), init_seed=3)
    policy_weights = policy.named_weights()
    same = ValueTrainer(SHAPE, ALGO, CriticConfig(init_from_policy=True), tp=1, device=torch.device("cpu"),
                        init_seed=3).named_weights()
    other = ValueTrainer(SHAPE, ALGO, CriticConfig(init_from_policy=False), tp=1, device=torch.device("cpu"),
                         init_seed=3).named_weights()
    trunk = [k for k in same if k.startswith("trunk.")]
    assert trunk and all(torch.equal(same[k], policy_weights[k[len("trunk."):]]) for k in trunk)
    assert not all(torch.equal(other[k], policy_weights[k[len("trunk."):]]) for k in trunk)
    # The policy's final norm is where the critic's norm starts (ones at init); the head is the critic's own.
    assert torch.equal(same["final_norm.weight"], policy_weights["decoder.final_layernorm.weight"])
    assert same["value_head.weight"].shape == (1, SHAPE.hidden_size)
