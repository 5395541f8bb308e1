"""GRPO advantages and the clipped policy loss, checked against values worked out by hand."""

import math

import pytest
import torch

from rlfw.algo.grpo import group_advantages, policy_loss

torch.set_num_threads(1)

EPS = 1e-6  # group_advantages' default std epsilon


# ------------------------------------------------------------------------------------------- group_advantages
def test_two_interleaved_groups_with_std_normalisation():
    # group 7: rewards 1, 0, 1, 0 -> mean 0.5, population std 0.5
    # group 3: rewards 3, 1, 2    -> mean 2,   population std sqrt(2/3)
    rewards = [1.0, 3.0, 0.0, 1.0, 1.0, 2.0, 0.0]
    groups = [7, 3, 7, 3, 7, 3, 7]
    s = math.sqrt(2.0 / 3.0)
    expected = [
        0.5 / (0.5 + EPS), 1.0 / (s + EPS), -0.5 / (0.5 + EPS), -1.0 / (s + EPS),
        0.5 / (0.5 + EPS), 0.0, -0.5 / (0.5 + EPS),
    ]
    assert group_advantages(rewards, groups) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_two_groups_without_std_normalisation():
    rewards = [1.0, 3.0, 0.0, 1.0, 1.0, 2.0, 0.0]
    groups = [7, 3, 7, 3, 7, 3, 7]
    expected = [0.5, 1.0, -0.5, -1.0, 0.5, 0.0, -0.5]
    assert group_advantages(rewards, groups, normalize_std=False) == pytest.approx(expected, abs=1e-12)


def test_advantages_depend_only_on_the_own_group():
    # Scaling the other group's rewards changes nothing for this group.
    base = group_advantages([1.0, 0.0, 5.0, 6.0], [0, 0, 1, 1])
    scaled = group_advantages([1.0, 0.0, 500.0, -6.0], [0, 0, 1, 1])
    assert base[:2] == pytest.approx(scaled[:2], abs=1e-15)
    assert base[:2] == pytest.approx([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)])


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("value", [0.7, 0.1, 1.0])  # 0.7 and 0.1: the float mean of three copies is not the value
def test_zero_variance_group_gets_exactly_zero_advantage(normalize_std, value):
    adv = group_advantages([value, value, value, 1.0, 0.0], [1, 1, 1, 2, 2], normalize_std=normalize_std)
    assert adv[:3] == [0.0, 0.0, 0.0]
    assert adv[3] > 0 > adv[4]


def test_result_is_a_list_of_floats_in_input_order():
    adv = group_advantages([2.0, 0.0], [5, 5])
    assert isinstance(adv, list) and all(isinstance(a, float) for a in adv)
    assert adv[0] > 0 > adv[1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_raises(bad):
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages([1.0, bad, 0.0], [0, 0, 1])


# ------------------------------------------------------------------------------------------------ policy_loss
def t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_ratio_one_loss_is_minus_weighted_advantage_sum():
    old = t([-1.0, -2.5, -0.3, -4.0])
    logprobs = old.clone().requires_grad_(True)
    adv = t([1.5, -0.5, 2.0, -1.0])
    w = t([0.1, 0.2, 0.3, 0.4])
    loss, stats = policy_loss(logprobs, old, adv, w, 0.2, 0.28)
    expected = -(1.5 * 0.1 - 0.5 * 0.2 + 2.0 * 0.3 - 1.0 * 0.4)  # -0.25
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(expected, abs=1e-12)
    assert stats["clip_frac"].item() == 0.0
    assert stats["ratio"].item() == pytest.approx(1.0, abs=1e-12)  # weighted sum of ratios = sum of weights
    assert "kl" not in stats
    loss.backward()
    # d loss / d logprob = -A * w * ratio, ratio = 1
    torch.testing.assert_close(logprobs.grad, -adv * w, rtol=0, atol=1e-12)


def test_clipped_case_by_hand():
    old = t([-2.0, -2.0, -2.0, -2.0])
    ratio = t([1.5, 0.5, 1.5, 0.5])
    logprobs = (old + ratio.log()).requires_grad_(True)
    adv = t([1.0, -1.0, -1.0, 1.0])
    w = t([0.1, 0.2, 0.3, 0.4])
    loss, stats = policy_loss(logprobs, old, adv, w, clip_eps_low=0.2, clip_eps_high=0.28)
    # token 0: r=1.5 > 1.28, A>0: max(-1.5, -1.28) = -1.28   (clipped, no gradient)
    # token 1: r=0.5 < 0.8,  A<0: max(0.5, 0.8)    = 0.8     (clipped, no gradient)
    # token 2: r=1.5,        A<0: max(1.5, 1.28)   = 1.5     (unclipped: pessimistic side)
    # token 3: r=0.5,        A>0: max(-0.5, -0.8)  = -0.5    (unclipped)
    expected = 0.1 * -1.28 + 0.2 * 0.8 + 0.3 * 1.5 + 0.4 * -0.5  # 0.282
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(expected, abs=1e-12)
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
    loss, stats = policy_loss(logprobs, old, adv, w, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.25 * 1.0 + 0.8 * 10.0, abs=1e-12)
    assert stats["clip_frac"].item() == pytest.approx(10.0)
    # swapped: eps_high = 0.2 clips r = 1.25 to 1.2; eps_low = 0.28 leaves r = 0.75 (> 0.72) alone
    loss, stats = policy_loss(logprobs, old, adv, w, clip_eps_low=0.28, clip_eps_high=0.2)
    assert loss.item() == pytest.approx(-1.2 * 1.0 + 0.75 * 10.0, abs=1e-12)
    assert stats["clip_frac"].item() == pytest.approx(1.0)


def test_k3_kl_term_by_hand():
    old = t([-1.0, -2.0, -0.5])
    logprobs = old.clone().requires_grad_(True)  # ratio 1
    adv = t([0.0, 0.0, 0.0])  # no policy-gradient term: the loss is the KL term alone
    ref = old + t([0.5, -0.3, 0.0])  # ref - pi
    w = t([1.0, 2.0, 3.0])
    kl_tok = [math.exp(0.5) - 0.5 - 1.0, math.exp(-0.3) + 0.3 - 1.0, 0.0]  # 0.148721..., 0.040818..., 0
    loss, stats = policy_loss(logprobs, old, adv, w, 0.2, 0.2, ref_logprobs=ref, kl_coef=0.1)
    assert stats["kl"].item() == pytest.approx(kl_tok[0] * 1.0 + kl_tok[1] * 2.0, abs=1e-12)
    assert loss.item() == pytest.approx(0.1 * (kl_tok[0] * 1.0 + kl_tok[1] * 2.0), abs=1e-12)
    loss.backward()
    # d/d pi of exp(ref - pi) - (ref - pi) - 1 = 1 - exp(ref - pi)
    expected_grad = [0.1 * w_ * (1.0 - math.exp(d)) for w_, d in zip([1.0, 2.0, 3.0], [0.5, -0.3, 0.0])]
    torch.testing.assert_close(logprobs.grad, t(expected_grad), rtol=0, atol=1e-12)


def test_kl_term_adds_to_pg_and_is_off_without_coef_or_ref():
    old = t([-1.0, -2.0])
    logprobs = old + t([0.1, -0.1])
    adv = t([1.0, -2.0])
    ref = old + t([0.4, 0.2])
    w = t([0.5, 0.5])
    pg, pg_stats = policy_loss(logprobs, old, adv, w, 0.2, 0.2)
    with_kl, stats = policy_loss(logprobs, old, adv, w, 0.2, 0.2, ref_logprobs=ref, kl_coef=0.3)
    assert with_kl.item() == pytest.approx(pg.item() + 0.3 * stats["kl"].item(), abs=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(pg_stats["pg_loss"].item(), abs=1e-15)
    assert stats["kl"].item() > 0
    for kwargs in ({"ref_logprobs": ref, "kl_coef": 0.0}, {"ref_logprobs": None, "kl_coef": 0.3}):
        loss, s = policy_loss(logprobs, old, adv, w, 0.2, 0.2, **kwargs)
        assert loss.item() == pg.item() and "kl" not in s


def test_zero_weight_tokens_contribute_nothing():
    old = t([-1.0, -2.0, -0.7, -3.0])
    lp = t([-0.9, -2.2, -0.7, -3.1])
    adv = t([1.0, -0.5, 0.3, 2.0])
    ref = t([-1.2, -1.8, -0.6, -2.9])
    w = t([0.25, 0.0, 0.5, 0.0])  # tokens 1 and 3 carry no loss

    def run(lp, old, adv, ref):
        lp = lp.clone().requires_grad_(True)
        loss, stats = policy_loss(lp, old, adv, w, 0.2, 0.28, ref_logprobs=ref, kl_coef=0.05)
        loss.backward()
        return loss.item(), {k: v.item() for k, v in stats.items()}, lp.grad

    base_loss, base_stats, base_grad = run(lp, old, adv, ref)
    # Arbitrary (finite) values at the zero-weight positions: heavy clipping, large KL, big advantages.
    other = [1, 3]
    lp2, old2, adv2, ref2 = lp.clone(), old.clone(), adv.clone(), ref.clone()
    lp2[other], old2[other], adv2[other], ref2[other] = t([2.0, -5.0]), t([-3.0, 0.0]), t([-50.0, 80.0]), t([-9.0, 4.0])
    loss2, stats2, grad2 = run(lp2, old2, adv2, ref2)

    assert loss2 == base_loss
    assert stats2 == base_stats
    assert grad2[other].tolist() == [0.0, 0.0]
    torch.testing.assert_close(grad2, base_grad, rtol=0, atol=0)
    # and the weighted tokens do matter
    assert base_grad[[0, 2]].abs().min() > 0
