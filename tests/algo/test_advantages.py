"""Advantage estimators (GRPO, RLOO, REINFORCE++), turn-level credit and the KL penalty in the reward, against
values worked out by hand."""

import math
from pathlib import Path

import numpy as np
import pytest

from rlfw.algo.advantages import (
    EPS,
    ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rlfw.config.schema import AlgoConfig
from rlfw.data.batch import RolloutBatch

GRPO = AlgoConfig(name="grpo", normalize_adv_std=True)
DR_GRPO = AlgoConfig(name="grpo", normalize_adv_std=False)
RLOO = AlgoConfig(name="rloo")
REINFORCE_PP = AlgoConfig(name="reinforce_pp", baseline="none")
REINFORCE_PP_BASELINE = AlgoConfig(name="reinforce_pp", baseline="group_mean")


def inputs(rewards, groups, lengths=None, token_rewards=None):
    lengths = lengths if lengths is not None else [1] * len(rewards)
    token_rewards = None if token_rewards is None else [np.asarray(r, dtype=np.float64) for r in token_rewards]
    return AdvantageInputs(np.asarray(rewards, dtype=np.float64), np.asarray(groups), np.asarray(lengths),
                           token_rewards)


# ----------------------------------------------------------------------------------------------------- GRPO
def test_grpo_two_interleaved_groups_with_std_normalisation():
    # group 7: rewards 1, 0, 1, 0 -> mean 0.5, population std 0.5
    # group 3: rewards 3, 1, 2    -> mean 2,   population std sqrt(2/3)
    rewards = [1.0, 3.0, 0.0, 1.0, 1.0, 2.0, 0.0]
    groups = [7, 3, 7, 3, 7, 3, 7]
    s = math.sqrt(2.0 / 3.0)
    expected = [
        0.5 / (0.5 + EPS), 1.0 / (s + EPS), -0.5 / (0.5 + EPS), -1.0 / (s + EPS),
        0.5 / (0.5 + EPS), 0.0, -0.5 / (0.5 + EPS),
    ]
    assert grpo_advantages(inputs(rewards, groups), GRPO) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_dr_grpo_is_the_group_centred_reward():
    rewards = [1.0, 3.0, 0.0, 1.0, 1.0, 2.0, 0.0]
    groups = [7, 3, 7, 3, 7, 3, 7]
    expected = [0.5, 1.0, -0.5, -1.0, 0.5, 0.0, -0.5]
    assert grpo_advantages(inputs(rewards, groups), DR_GRPO) == pytest.approx(expected, abs=1e-12)


def test_grpo_advantages_depend_only_on_the_own_group():
    base = grpo_advantages(inputs([1.0, 0.0, 5.0, 6.0], [0, 0, 1, 1]), GRPO)
    scaled = grpo_advantages(inputs([1.0, 0.0, 500.0, -6.0], [0, 0, 1, 1]), GRPO)
    assert base[:2] == pytest.approx(scaled[:2], abs=1e-15)
    assert base[:2] == pytest.approx([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)])


@pytest.mark.parametrize("algo", [GRPO, DR_GRPO, RLOO], ids=lambda a: f"{a.name}")
@pytest.mark.parametrize("value", [0.7, 0.1, 1.0])  # 0.7 and 0.1: the float mean of three copies is not the value
def test_zero_variance_group_gets_exactly_zero_advantage(algo, value):
    # unequal response lengths: a group estimator's advantage must not depend on them
    adv = ESTIMATORS[algo.name].compute(inputs([value, value, value, 1.0, 0.0], [1, 1, 1, 2, 2], [1, 1, 1, 1, 3]),
                                        algo)
    assert adv[:3] == [0.0, 0.0, 0.0]
    assert adv[3] > 0 > adv[4]


def test_reinforce_pp_baseline_whitens_a_zero_variance_group_away_from_zero():
    """REINFORCE++-baseline subtracts the group mean (0 for an all-equal group), then normalises over every response
    token of the batch: with unequal lengths the token mean is not 0, so the all-equal group moves with it. By hand:
    token values [0, 0, 0, 0.5, -0.5, -0.5, -0.5] have mean -1/7 and std sqrt(6)/7, so (0 + 1/7) / (sqrt(6)/7 + EPS)."""
    adv = ESTIMATORS["reinforce_pp"].compute(inputs([0.7, 0.7, 0.7, 1.0, 0.0], [1, 1, 1, 2, 2], [1, 1, 1, 1, 3]),
                                             REINFORCE_PP_BASELINE)
    assert adv[:3] == pytest.approx([(1 / 7) / (6 ** 0.5 / 7 + EPS)] * 3, rel=1e-12)


# ----------------------------------------------------------------------------------------------------- RLOO
def test_rloo_baseline_is_the_mean_of_the_other_samples():
    # group 0: rewards 1, 0, 0.5 -> 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0
    # group 1: rewards 2, 4      -> 2 - 4 = -2; 4 - 2 = 2
    adv = rloo_advantages(inputs([1.0, 2.0, 0.0, 4.0, 0.5], [0, 1, 0, 1, 0]), RLOO)
    assert adv == pytest.approx([0.75, -2.0, -0.75, 2.0, 0.0], abs=1e-12)
    assert all(isinstance(a, float) for a in adv)


# ---------------------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_normalises_over_every_response_token():
    # rewards 1, 0, 0 with 1, 2, 1 response tokens: token values 1, 0, 0, 0 -> mean 0.25,
    # variance (0.75^2 + 3 * 0.25^2) / 4 = 0.1875 (a mean over samples would be 1/3: the tokens decide)
    s = math.sqrt(0.1875)
    adv = reinforce_pp_advantages(inputs([1.0, 0.0, 0.0], [0, 1, 2], lengths=[1, 2, 1]), REINFORCE_PP)
    assert adv == pytest.approx([0.75 / (s + EPS), -0.25 / (s + EPS), -0.25 / (s + EPS)], rel=1e-12)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_normalises():
    # rewards 1, 0 | 3, 5 (groups 0 | 1) -> centred 0.5, -0.5 | -1, 1; lengths 1, 1, 1, 3
    # tokens 0.5, -0.5, -1, 1, 1, 1: mean 2/6 = 1/3; squared deviations 1/36, 25/36, 64/36, 3 x 16/36 = 138/36,
    # variance 138/216
    s = math.sqrt(138 / 216)
    adv = reinforce_pp_advantages(inputs([1.0, 0.0, 3.0, 5.0], [0, 0, 1, 1], lengths=[1, 1, 1, 3]),
                                  REINFORCE_PP_BASELINE)
    expected = [(1 / 6) / (s + EPS), (-5 / 6) / (s + EPS), (-4 / 3) / (s + EPS), (2 / 3) / (s + EPS)]
    assert adv == pytest.approx(expected, rel=1e-12)


def test_reinforce_pp_equal_returns_give_zero():
    assert reinforce_pp_advantages(inputs([0.4, 0.4], [0, 1], lengths=[2, 3]), REINFORCE_PP) == [0.0, 0.0]


# ------------------------------------------------------------------------------------- KL penalty in the reward
def test_per_token_rewards_enter_as_rewards_to_go():
    # Dr. GRPO on rewards 1, 0 (one group): 0.5, -0.5. Token rewards -0.1, -0.2, 0 | -0.4 have suffix sums
    # -0.3, -0.2, 0 | -0.4, so the advantages are 0.2, 0.3, 0.5 | -0.9.
    adv = grpo_advantages(inputs([1.0, 0.0], [0, 0], [3, 1], [[-0.1, -0.2, 0.0], [-0.4]]), DR_GRPO)
    assert adv[0] == pytest.approx([0.2, 0.3, 0.5], abs=1e-12)
    assert adv[1] == pytest.approx([-0.9], abs=1e-12)


def test_reinforce_pp_normalises_after_the_penalty():
    # returns: 1 + suffix sums of -0.5, 0 -> 0.5, 1.0 | 0 + 0 -> 0.0; tokens 0.5, 1, 0: mean 0.5, variance 1/6
    s = math.sqrt(1 / 6)
    adv = reinforce_pp_advantages(inputs([1.0, 0.0], [0, 1], [2, 1], [[-0.5, 0.0], [0.0]]), REINFORCE_PP)
    assert adv[0] == pytest.approx([0.0, 0.5 / (s + EPS)], abs=1e-12)
    assert adv[1] == pytest.approx([-0.5 / (s + EPS)], abs=1e-12)


def rollout_batch(**columns):
    base = {"sample_id": [0, 1], "group_id": [4, 4], "tokens": [[5, 6, 7, 8], [5, 6, 9]], "prompt_len": [2, 2],
            "reward": [1.0, 0.0], "old_logprobs": [[-1.0, -2.0], [-0.5]], "ref_logprobs": [[-1.5, -1.0], [-0.5]]}
    return RolloutBatch({**base, **columns}, {"step": 0})


def test_compute_advantages_with_a_k1_reward_penalty():
    # RLOO on rewards 1, 0: 1, -1. k1 = old - ref = 0.5, -1.0 | 0; token rewards -0.5 * k1 = -0.25, 0.5 | 0;
    # suffix sums 0.25, 0.5 | 0 -> advantages 1.25, 1.5 | -1.0. Mean k1 over the 3 tokens: -1/6.
    algo = AlgoConfig(name="rloo", kl_reward_coef=0.5, kl_estimator="k1")
    adv, stats = compute_advantages(rollout_batch(), algo)
    assert adv == [pytest.approx([1.25, 1.5], abs=1e-12), pytest.approx([-1.0], abs=1e-12)]
    assert all(isinstance(x, float) for x in adv[0])
    assert stats["reward/kl"] == pytest.approx(-1 / 6, abs=1e-12)


def test_compute_advantages_without_penalty_is_one_float_per_sample():
    adv, stats = compute_advantages(rollout_batch(), RLOO)
    assert adv == [1.0, -1.0] and stats == {}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_raises(bad):
    with pytest.raises(ValueError, match="NaN or inf reward"):
        compute_advantages(rollout_batch(reward=[1.0, bad]), GRPO)


# ------------------------------------------------------------------------------------------------ the registry
def test_every_estimator_has_a_config_file_and_every_file_an_estimator():
    conf = Path(__file__).resolve().parents[2] / "conf" / "algo"
    assert {p.stem for p in conf.glob("*.yaml")} == set(ESTIMATORS)
    assert {"grpo", "rloo", "reinforce_pp"} <= set(ESTIMATORS)


# ----------------------------------------------------------------------------------------------- turn-level credit
# One group of three episodes: the third answered in one turn. Per response token, its turn (the first episode's
# third token is the observation that answered turn 0: it goes with turn 0, and the loss mask leaves it out).
TURN_REWARDS = [[1.0, 0.0], [0.0, 1.0], [0.5]]
TOKEN_TURNS = [[0, 0, 0, 1], [0, 0, 1, 1], [0, 0]]


def turn_inputs(turn_rewards=TURN_REWARDS, token_turns=TOKEN_TURNS, groups=(1, 1, 1)):
    return AdvantageInputs(np.asarray([sum(r) for r in turn_rewards]), np.asarray(groups),
                           np.asarray([len(t) for t in token_turns]), turn_rewards=turn_rewards,
                           token_turns=token_turns)


def test_turn_credit_without_discount_credits_each_turn_with_its_own_reward_against_the_same_turn():
    # turn 0: 1, 0, 0.5 (mean 0.5); turn 1: 0, 1 among the two episodes that took it (mean 0.5)
    algo = AlgoConfig(name="grpo", normalize_adv_std=False, turn_discount=0.0)
    assert grpo_advantages(turn_inputs(), algo) == [[0.5, 0.5, 0.5, -0.5], [-0.5, -0.5, 0.5, 0.5], [0.0, 0.0]]
    # RLOO: the mean of the others that took the turn
    rloo = AlgoConfig(name="rloo", turn_discount=0.0)
    assert rloo_advantages(turn_inputs(), rloo) == [[0.75, 0.75, 0.75, -1.0], [-0.75, -0.75, 1.0, 1.0], [0.0, 0.0]]


def test_turn_credit_with_full_discount_credits_a_turn_with_what_follows_it_too():
    # returns: turn 0: 1, 1, 0.5 (mean 5/6); turn 1: 0, 1
    algo = AlgoConfig(name="grpo", normalize_adv_std=False, turn_discount=1.0)
    advantages = grpo_advantages(turn_inputs(), algo)
    assert advantages == [pytest.approx([1 / 6] * 3 + [-0.5]), pytest.approx([1 / 6] * 2 + [0.5] * 2),
                          pytest.approx([-1 / 3] * 2)]
    half = grpo_advantages(turn_inputs(), AlgoConfig(name="grpo", normalize_adv_std=False, turn_discount=0.5))
    assert half[1][0] == pytest.approx(0.5 - (1 + 0.5 + 0.5) / 3)  # turn 0's return 0 + 0.5 x 1


def test_turn_credit_of_one_turn_episodes_is_the_sequence_level_advantage():
    rewards, groups = [[1.0], [3.0], [0.0], [1.0]], (7, 3, 7, 3)
    single = turn_inputs(rewards, [[0, 0], [0], [0, 0, 0], [0]], groups)
    for algo in (AlgoConfig(name="grpo", normalize_adv_std=True), AlgoConfig(name="rloo")):
        sequence = ESTIMATORS[algo.name].compute(single, algo)
        for discount in (0.0, 1.0):
            turned = AlgoConfig(**{**algo.__dict__, "turn_discount": discount})
            assert ESTIMATORS[algo.name].compute(single, turned) == sequence
