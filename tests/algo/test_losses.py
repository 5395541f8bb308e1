"""The policy loss and each of its options, against values worked out by hand."""

import math

import pytest
import torch

from rlfw.algo.losses import kl_penalty, old_logprobs_from_training, policy_loss
from rlfw.config.schema import AlgoConfig

torch.set_num_threads(1)

PLAIN = AlgoConfig(name="grpo", clip_eps_low=0.2, clip_eps_high=0.28)


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def leaf(values):
    return t(values).requires_grad_(True)


# ---------------------------------------------------------------------------------------------- clipped PG
def test_ratio_one_loss_is_minus_weighted_advantage_sum():
    old = t([-1.0, -2.5, -0.3, -4.0])
    logprobs = old.clone().requires_grad_(True)
    adv = t([1.5, -0.5, 2.0, -1.0])
    w = t([0.1, 0.2, 0.3, 0.4])
    loss, stats = policy_loss(logprobs, old, adv, w, PLAIN)
    expected = -(1.5 * 0.1 - 0.5 * 0.2 + 2.0 * 0.3 - 1.0 * 0.4)  # -0.25
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(expected, abs=1e-12)
    assert stats["clip_frac"].item() == 0.0
    assert stats["ratio"].item() == pytest.approx(1.0, abs=1e-12)  # weighted sum of ratios = sum of weights
    assert stats["nonfinite_ratio"].item() == 0 and stats["nonfinite_loss"].item() == 0
    assert not {"kl", "entropy", "dual_clip_frac", "tis_weight"} & set(stats)
    loss.backward()
    # d loss / d logprob = -A * w * ratio, ratio = 1
    torch.testing.assert_close(logprobs.grad, -adv * w, rtol=0, atol=1e-12)


def test_no_old_logprobs_means_the_current_policy():
    """``old_logprobs=None`` (taken from the training forward): the loss, its gradient and the TIS weight are those
    of old = the current log-probs, detached; ``logprob_abs_diff`` is the weighted |old - rollout|."""
    algo = AlgoConfig(name="grpo", clip_eps_low=0.2, clip_eps_high=0.28, tis_cap=2.0)
    adv, w = t([1.5, -0.5, 2.0, -1.0]), t([0.1, 0.2, 0.3, 0.4])
    rollout = t([-1.1, -2.0, -0.5, -3.0])
    given, none = leaf([-1.0, -2.5, -0.3, -4.0]), leaf([-1.0, -2.5, -0.3, -4.0])
    loss, stats = policy_loss(given, given.detach(), adv, w, algo, rollout_logprobs=rollout)
    loss_none, stats_none = policy_loss(none, None, adv, w, algo, rollout_logprobs=rollout)
    loss.backward()
    loss_none.backward()
    assert loss_none.item() == loss.item() and torch.equal(none.grad, given.grad)
    assert stats_none.keys() == stats.keys() and all(torch.equal(stats_none[k], stats[k]) for k in stats)
    assert stats["logprob_abs_diff"].item() == pytest.approx(0.1 * 0.1 + 0.2 * 0.5 + 0.3 * 0.2 + 0.4 * 1.0)


@pytest.mark.parametrize("change,from_training", [
    ({}, True),
    ({"old_logprobs": "recompute"}, False),
    ({"kl_loss_coef": 0.1}, False),  # the reference's log-probs come from the pass
    ({"kl_reward_coef": 0.1}, False),
])
def test_when_the_old_logprobs_come_from_the_training_forward(change, from_training):
    algo = AlgoConfig(name="grpo", **change)
    assert old_logprobs_from_training(algo, num_minibatches=1) is from_training
    assert not old_logprobs_from_training(algo, num_minibatches=2)  # later minibatches train on moved weights


def test_clipped_case_by_hand():
    old = t([-2.0, -2.0, -2.0, -2.0])
    ratio = t([1.5, 0.5, 1.5, 0.5])
    logprobs = (old + ratio.log()).requires_grad_(True)
    adv = t([1.0, -1.0, -1.0, 1.0])
    w = t([0.1, 0.2, 0.3, 0.4])
    loss, stats = policy_loss(logprobs, old, adv, w, PLAIN)
    # token 0: r=1.5 > 1.28, A>0: max(-1.5, -1.28) = -1.28   (clipped, no gradient)
    # token 1: r=0.5 < 0.8,  A<0: max(0.5, 0.8)    = 0.8     (clipped, no gradient)
    # token 2: r=1.5,        A<0: max(1.5, 1.28)   = 1.5     (unclipped: pessimistic side)
    # token 3: r=0.5,        A>0: max(-0.5, -0.8)  = -0.5    (unclipped)
    expected = 0.1 * -1.28 + 0.2 * 0.8 + 0.3 * 1.5 + 0.4 * -0.5  # 0.282
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["clip_frac"].item() == pytest.approx(0.1 + 0.2, abs=1e-12)
    assert stats["ratio"].item() == pytest.approx(0.1 * 1.5 + 0.2 * 0.5 + 0.3 * 1.5 + 0.4 * 0.5, abs=1e-12)
    loss.backward()
    # unclipped tokens: d(-A * r * w)/d logprob = -A * r * w; clipped tokens: 0
    torch.testing.assert_close(logprobs.grad, t([0.0, 0.0, 1.0 * 1.5 * 0.3, -1.0 * 0.5 * 0.4]), rtol=0, atol=1e-12)


def test_clip_bounds_are_asymmetric():
    old = t([0.0, 0.0])
    logprobs = t([math.log(1.25), math.log(0.75)])
    adv = t([1.0, -1.0])
    w = t([1.0, 10.0])
    # eps_high = 0.28 leaves r = 1.25 alone; eps_low = 0.2 clips r = 0.75 up to 0.8
    loss, stats = policy_loss(logprobs, old, adv, w, AlgoConfig(name="grpo", clip_eps_low=0.2, clip_eps_high=0.28))
    assert loss.item() == pytest.approx(-1.25 * 1.0 + 0.8 * 10.0, abs=1e-12)
    assert stats["clip_frac"].item() == pytest.approx(10.0)
    # swapped: eps_high = 0.2 clips r = 1.25 to 1.2; eps_low = 0.28 leaves r = 0.75 (> 0.72) alone
    loss, stats = policy_loss(logprobs, old, adv, w, AlgoConfig(name="grpo", clip_eps_low=0.28, clip_eps_high=0.2))
    assert loss.item() == pytest.approx(-1.2 * 1.0 + 0.75 * 10.0, abs=1e-12)
    assert stats["clip_frac"].item() == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------- dual clip
def test_dual_clip_caps_negative_advantage_tokens():
    old = t([0.0, 0.0, 0.0])
    logprobs = leaf([math.log(5.0), math.log(2.0), math.log(5.0)])
    adv = t([-1.0, -1.0, 1.0])
    w = t([1.0, 1.0, 1.0])
    algo = AlgoConfig(name="grpo", clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0)
    loss, stats = policy_loss(logprobs, old, adv, w, algo)
    # token 0: A=-1, r=5: max(5, 1.2) = 5, above c*|A| = 3 -> 3 (dual-clipped, no gradient)
    # token 1: A=-1, r=2: max(2, 1.2) = 2, below 3          -> 2 (gradient -A * r = 2)
    # token 2: A=+1, r=5: max(-5, -1.2) = -1.2 (ordinary clip; dual clip only bounds A < 0)
    assert loss.item() == pytest.approx(3.0 + 2.0 - 1.2, abs=1e-12)
    assert stats["dual_clip_frac"].item() == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([0.0, 2.0, 0.0]), rtol=0, atol=1e-12)
    # without dual clip token 0 costs 5
    assert policy_loss(logprobs, old, adv, w, PLAIN)[0].item() == pytest.approx(5.0 + 2.0 - 1.28, abs=1e-12)


# ------------------------------------------------------------------------------ truncated importance sampling
def test_tis_weights_the_pg_term_by_the_capped_trainer_over_engine_ratio():
    old = t([-1.0, -1.0])
    rollout = t([-1.5, -0.2])  # exp(old - rollout) = exp(0.5) = 1.6487 -> capped at 1.5; exp(-0.8) = 0.449329
    logprobs = old.clone().requires_grad_(True)  # ratio 1: pg per token = -A
    adv = t([1.0, -2.0])
    w = t([0.5, 0.25])
    tis = [1.5, math.exp(-0.8)]
    loss, stats = policy_loss(logprobs, old, adv, w, AlgoConfig(name="grpo", tis_cap=1.5), rollout_logprobs=rollout)
    # 0.5 * (-1 * 1.5) + 0.25 * (2 * 0.449329) = -0.75 + 0.224664
    assert loss.item() == pytest.approx(0.5 * -1.0 * tis[0] + 0.25 * 2.0 * tis[1], abs=1e-12)
    assert stats["tis_weight"].item() == pytest.approx(0.5 * tis[0] + 0.25 * tis[1], abs=1e-12)
    loss.backward()  # the weight is a constant: d/d logprob = -A * r * tis * w
    torch.testing.assert_close(logprobs.grad, t([-1.0 * tis[0] * 0.5, 2.0 * tis[1] * 0.25]), rtol=0, atol=1e-12)


def test_decoupled_objective_on_stale_samples_is_the_on_policy_gradient():
    """loop=async's objective (the PPO ratio against the proximal policy, each token weighed by pi_prox / pi_behaviour):
    in expectation over tokens drawn from an older (behaviour) policy it is the exact policy gradient of the current
    one, -grad sum_a pi(a) A(a). Exact expectation over a 5-token vocabulary (each token weighed by its behaviour
    probability), no sampling noise; without the weight the gradient is the behaviour policy's, not the current's."""
    theta = leaf([0.3, -1.2, 0.8, 0.0, 2.0])  # the current (= proximal) policy's logits
    behaviour = torch.log_softmax(t([1.0, 0.5, -0.5, 0.2, 0.1]), dim=0)  # an older policy's, which sampled
    advantages = t([1.0, -2.0, 0.5, 3.0, -1.0])
    cap = 100.0  # above every pi/beta here: the weight is exact

    def gradient(algo):
        theta.grad = None
        logprobs = torch.log_softmax(theta, dim=0)
        loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, behaviour.exp(), algo,
                              rollout_logprobs=behaviour)
        loss.backward()
        return theta.grad.clone()

    exact = torch.autograd.grad(-(torch.softmax(theta, dim=0) * advantages).sum(), theta)[0]
    torch.testing.assert_close(gradient(AlgoConfig(name="grpo", tis_cap=cap)), exact, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(gradient(AlgoConfig(name="grpo")), exact, atol=1e-3)


def test_tis_without_rollout_logprobs_is_an_error():
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(t([-1.0]), t([-1.0]), t([1.0]), t([1.0]), AlgoConfig(name="grpo", tis_cap=2.0))


# ---------------------------------------------------------------------------------------------------- KL loss
D = [0.5, -0.3]  # log pi - log ref of two tokens
KL_BY_HAND = {
    # value, d value / d log pi
    "k1": ([0.5, -0.3], [1.0, 1.0]),
    "k2": ([0.5 * 0.25, 0.5 * 0.09], D),
    # k3 = exp(-d) - 1 + d; gradient 1 - exp(-d)
    "k3": ([math.exp(-0.5) - 1 + 0.5, math.exp(0.3) - 1 - 0.3], [1 - math.exp(-0.5), 1 - math.exp(0.3)]),
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_estimators_by_hand(estimator):
    logprobs = leaf([-1.0, -2.0])
    ref = t([-1.5, -1.7])
    adv = t([0.0, 0.0])  # no policy-gradient term: the loss is the KL term alone
    w = t([1.0, 2.0])
    values, grads = KL_BY_HAND[estimator]
    torch.testing.assert_close(kl_penalty(logprobs.detach(), ref, estimator), t(values), rtol=0, atol=1e-12)
    algo = AlgoConfig(name="grpo", kl_loss_coef=0.1, kl_estimator=estimator)
    loss, stats = policy_loss(logprobs, logprobs.detach(), adv, w, algo, ref_logprobs=ref)
    assert stats["kl"].item() == pytest.approx(values[0] * 1.0 + values[1] * 2.0, abs=1e-12)
    assert loss.item() == pytest.approx(0.1 * (values[0] * 1.0 + values[1] * 2.0), abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([0.1 * 1.0 * grads[0], 0.1 * 2.0 * grads[1]]), rtol=0, atol=1e-12)


def test_kl_loss_adds_to_pg_and_needs_the_reference():
    old = t([-1.0, -2.0])
    logprobs = old + t([0.1, -0.1])
    adv = t([1.0, -2.0])
    ref = old + t([0.4, 0.2])
    w = t([0.5, 0.5])
    pg, pg_stats = policy_loss(logprobs, old, adv, w, PLAIN)
    algo = AlgoConfig(name="grpo", clip_eps_high=0.28, kl_loss_coef=0.3)
    with_kl, stats = policy_loss(logprobs, old, adv, w, algo, ref_logprobs=ref)
    assert with_kl.item() == pytest.approx(pg.item() + 0.3 * stats["kl"].item(), abs=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(pg_stats["pg_loss"].item(), abs=1e-15)
    assert stats["kl"].item() > 0
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, adv, w, algo)


# ---------------------------------------------------------------------------------------------------- entropy
def test_entropy_bonus_lowers_the_loss_by_coef_times_weighted_entropy():
    old = t([-1.0, -1.0])
    logprobs = old.clone().requires_grad_(True)
    entropy = leaf([0.7, 1.2])
    w = t([1.0, 0.5])
    loss, stats = policy_loss(logprobs, old, t([0.0, 0.0]), w, AlgoConfig(name="grpo", entropy_coef=0.01),
                              entropy=entropy)
    assert loss.item() == pytest.approx(-0.01 * (0.7 * 1.0 + 1.2 * 0.5), abs=1e-12)  # -0.013
    assert stats["entropy"].item() == pytest.approx(1.3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(entropy.grad, t([-0.01, -0.005]), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------- zero weights, NaN and inf
def test_zero_weight_tokens_contribute_nothing_even_with_extreme_inputs():
    w = t([0.25, 0.0, 0.5, 0.0])  # tokens 1 and 3 carry no loss (prompt positions, sequence ends)
    algo = AlgoConfig(name="grpo", clip_eps_high=0.28, kl_loss_coef=0.05, tis_cap=2.0, dual_clip_c=3.0,
                      entropy_coef=0.01)

    def run(lp, old, adv, ref, rollout, entropy):
        lp = lp.clone().requires_grad_(True)
        loss, stats = policy_loss(lp, old, adv, w, algo, ref_logprobs=ref, rollout_logprobs=rollout,
                                  entropy=entropy)
        loss.backward()
        return loss.item(), {k: v.item() for k, v in stats.items()}, lp.grad

    lp, old = t([-0.9, -2.2, -0.7, -3.1]), t([-1.0, -2.0, -0.7, -3.0])
    adv, ref, rollout = t([1.0, -0.5, 0.3, 2.0]), t([-1.2, -1.8, -0.6, -2.9]), t([-1.1, -2.0, -0.8, -3.0])
    entropy = t([0.5, 0.6, 0.7, 0.8])
    base_loss, base_stats, base_grad = run(lp, old, adv, ref, rollout, entropy)
    # At the zero-weight positions: values whose exp() overflows (ref - logprob = 800) or that are infinite.
    other = [1, 3]
    lp2, old2, adv2, ref2, rollout2 = lp.clone(), old.clone(), adv.clone(), ref.clone(), rollout.clone()
    lp2[other], old2[other], adv2[other] = t([-800.0, 2.0]), t([0.0, -900.0]), t([-50.0, math.inf])
    ref2[other], rollout2[other] = t([0.0, 4.0]), t([-700.0, 0.0])
    loss2, stats2, grad2 = run(lp2, old2, adv2, ref2, rollout2, entropy)
    assert loss2 == base_loss
    assert stats2 == base_stats and stats2["nonfinite_ratio"] == 0 == stats2["nonfinite_loss"]
    assert grad2[other].tolist() == [0.0, 0.0]
    torch.testing.assert_close(grad2, base_grad, rtol=0, atol=0)
    assert base_grad[[0, 2]].abs().min() > 0  # and the weighted tokens do matter


def test_non_finite_ratio_and_loss_on_weighted_tokens_are_counted():
    w = t([1.0, 1.0, 1.0])
    # token 0: old = -inf -> ratio inf (A > 0 clips it to a finite loss, but the ratio is counted);
    # token 1: a NaN advantage -> NaN loss; token 2: fine
    _, stats = policy_loss(t([-1.0, -1.0, -1.0]), t([-math.inf, -1.0, -1.0]), t([1.0, math.nan, 1.0]), w, PLAIN)
    assert stats["nonfinite_ratio"].item() == 1
    assert stats["nonfinite_loss"].item() == 1
