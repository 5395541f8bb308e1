"""Advantage estimators, one registry entry per ``algo.name``.

Where they run: in the driver, on the whole rollout batch, after the trainer has attached its log-probs and
before the batch is split (``rlfw.loop``: generate -> log-probs -> advantages -> split -> train). Not in the rollout
manager, because not every input exists there: a KL penalty in the reward (``algo.kl_reward_coef``) needs the
frozen reference model's log-probs, which only the trainer computes, after the rollout; REINFORCE++ normalises
over the whole batch *after* that penalty is added; GAE will need the critic's values, computed the same way.
So every estimator runs in one place that has every input, and it still sees whole prompt groups.

The KL penalty enters as a per-token reward ``-kl_reward_coef * KL_t`` summed as rewards-to-go (no discount):
token t's advantage is the sequence-level advantage plus the penalty of the tokens from t to the end, the part of
the divergence that token t still influences. (A per-sample KL sum would charge every token for divergence it
came after.) With the penalty on, the ``advantage`` column holds a list per response token; without it, one float
per sample.

**Turn-level credit** (``algo.turn_discount``, GRPO and RLOO): an episode's reward is the sum of its turns' rewards
(``rlfw.rollout.envs.base``). By default every policy token is credited with that sum. With a discount g set, the
tokens of turn k are credited with the turn's return ``r_k + g r_(k+1) + g^2 r_(k+2) ...``, its baseline taken
among the episodes of the same prompt that reached turn k: g = 1 credits a turn with what it and the turns after it
earned, g = 0 with its own reward only. One-turn episodes get the sequence-level advantage whatever g.

Adding an estimator (e.g. ``ppo`` with GAE over critic values) is one function from ``AdvantageInputs`` to
advantages and one ``ESTIMATORS`` entry; ``validate`` and the ``conf/algo`` files read the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlfw.algo.gae import gae_advantages
from rlfw.algo.losses import kl_penalty
from rlfw.data.batch import RolloutBatch

if TYPE_CHECKING:
    from rlfw.config.schema import AlgoConfig

EPS = 1e-6  # added to a standard deviation before dividing by it

# One entry per sample: a float (the same advantage for every response token) or one float per response token.
Advantages = list[float | list[float]]


@dataclass(frozen=True)
class AdvantageInputs:
    rewards: np.ndarray  # [N] sequence-level rewards
    group_ids: np.ndarray  # [N] the prompt group of each sample
    response_lengths: np.ndarray  # [N] response tokens per sample
    token_rewards: list[np.ndarray] | None = None  # per response token, added as rewards-to-go (KL penalty)
    values: list[list[float]] | None = None  # per response token, the critic's V(s_t) (ppo)
    turn_rewards: list[list[float]] | None = None  # per sample, each policy turn's reward (turn-level credit)
    token_turns: list[list[int]] | None = None  # per response token, the turn it belongs to


@dataclass(frozen=True)
class Estimator:
    compute: Callable[[AdvantageInputs, AlgoConfig], Advantages]
    options: Mapping[str, tuple]  # estimator-specific algo options it reads, with their allowed values
    uses_groups: Callable[[AlgoConfig], bool]  # whether its baseline comes from the prompt group


def _per_group(rewards: np.ndarray, group_ids: np.ndarray, centre: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``centre`` applied to each group's rewards; a group whose rewards are all equal gets exactly 0 (the float
    mean of e.g. 0.7, 0.7, 0.7 is not exactly 0.7), as does a group of one sample (no baseline to compare with)."""
    out = np.zeros_like(rewards)
    for group in np.unique(group_ids):
        members = group_ids == group
        if np.ptp(rewards[members]) > 0:
            out[members] = centre(rewards[members])
    return out


def group_mean_baseline(rewards: np.ndarray, group_ids: np.ndarray, normalize_std: bool = False) -> np.ndarray:
    """r - mean of its group, divided by (the group's std + EPS) when ``normalize_std``."""
    if normalize_std:
        return _per_group(rewards, group_ids, lambda r: (r - r.mean()) / (r.std() + EPS))
    return _per_group(rewards, group_ids, lambda r: r - r.mean())


def leave_one_out_baseline(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """r_i - mean of the *other* samples of its group: an unbiased baseline, since it does not depend on sample i."""
    return _per_group(rewards, group_ids, lambda r: r - (r.sum() - r) / (len(r) - 1))


def add_rewards_to_go(sequence: np.ndarray, token_rewards: list[np.ndarray] | None) -> list:
    """Per sample, ``sequence[i]`` plus the suffix sums of its per-token rewards (a scalar when there are none)."""
    if token_rewards is None:
        return list(sequence)
    return [a + np.cumsum(r[::-1])[::-1] for a, r in zip(sequence, token_rewards)]


def normalize_over_tokens(values: Sequence, lengths: np.ndarray) -> list:
    """(v - mean) / (std + EPS) with the mean and std over every response token of the batch (a per-sample value
    counts once per token of its response), as REINFORCE++ whitens its returns."""
    tokens = np.concatenate([np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)) for v, n in zip(values, lengths)])
    if tokens.size == 0 or np.ptp(tokens) == 0:
        return [np.zeros(np.shape(v)) for v in values]
    mean, std = tokens.mean(), tokens.std()
    return [(v - mean) / (std + EPS) for v in values]


def as_column(values: Sequence) -> Advantages:
    """Plain Python floats for the batch column: a float per sample, or a list of floats per response token."""
    return [float(v) if np.ndim(v) == 0 else [float(x) for x in v] for v in values]


def turn_returns(turn_rewards: Sequence[float], discount: float) -> np.ndarray:
    """Per turn, its reward plus the later turns' discounted by ``discount`` per turn."""
    returns = np.zeros(len(turn_rewards))
    following = 0.0
    for k in range(len(turn_rewards) - 1, -1, -1):
        following = returns[k] = turn_rewards[k] + discount * following
    return returns


def per_turn(inputs: AdvantageInputs, discount: float,
             baseline: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> list[np.ndarray] | np.ndarray:
    """Per sample, each response token's advantage: its turn's return (``turn_returns``) against ``baseline`` among
    the samples of its group that reached that turn. Without several turns in the batch: ``baseline`` of the
    sequence rewards, one float per sample (the sequence-level advantage, which it equals then)."""
    if inputs.turn_rewards is None or max(map(len, inputs.turn_rewards), default=0) <= 1:
        return baseline(inputs.rewards, inputs.group_ids)
    returns = [turn_returns(r, discount) for r in inputs.turn_rewards]
    by_turn = [np.zeros(len(r)) for r in returns]
    for k in range(max(map(len, returns))):
        reached = [i for i, r in enumerate(returns) if len(r) > k]
        centred = baseline(np.asarray([returns[i][k] for i in reached]), inputs.group_ids[reached])
        for i, value in zip(reached, centred):
            by_turn[i][k] = value
    return [a[np.asarray(turns, dtype=np.int64)] for a, turns in zip(by_turn, inputs.token_turns)]


# ------------------------------------------------------------------------------------------------- estimators
def grpo_advantages(inputs: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    """GRPO: (r - group mean) / group std; Dr. GRPO without the std (``algo.normalize_adv_std=false``)."""
    baseline = lambda r, g: group_mean_baseline(r, g, algo.normalize_adv_std)  # noqa: E731
    sequence = baseline(inputs.rewards, inputs.group_ids) if algo.turn_discount is None else \
        per_turn(inputs, algo.turn_discount, baseline)
    return as_column(add_rewards_to_go(sequence, inputs.token_rewards))


def rloo_advantages(inputs: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    """RLOO: r - mean of the other samples of the same prompt."""
    sequence = leave_one_out_baseline(inputs.rewards, inputs.group_ids) if algo.turn_discount is None else \
        per_turn(inputs, algo.turn_discount, leave_one_out_baseline)
    return as_column(add_rewards_to_go(sequence, inputs.token_rewards))


def reinforce_pp_advantages(inputs: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    """REINFORCE++: returns (r, or r - group mean with ``algo.baseline=group_mean``: REINFORCE++-baseline, plus the
    per-token rewards-to-go) normalised over all response tokens of the batch."""
    sequence = inputs.rewards
    if algo.baseline == "group_mean":
        sequence = group_mean_baseline(inputs.rewards, inputs.group_ids)
    returns = add_rewards_to_go(sequence, inputs.token_rewards)
    return as_column(normalize_over_tokens(returns, inputs.response_lengths))


def ppo_advantages(inputs: AdvantageInputs, algo: AlgoConfig) -> Advantages:
    """PPO: GAE over the critic's values, per response token (``rlfw.algo.gae``); a KL penalty is a per-token
    reward, discounted like the sequence reward."""
    if inputs.values is None:
        raise ValueError("algo.name='ppo' needs the critic's values (batch column old_values)")
    return as_column(gae_advantages(inputs.rewards, inputs.values, inputs.token_rewards, algo.gamma, algo.gae_lambda))


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo_advantages, {"normalize_adv_std": (True, False)}, lambda algo: True),
    "rloo": Estimator(rloo_advantages, {}, lambda algo: True),
    "reinforce_pp": Estimator(
        reinforce_pp_advantages, {"baseline": ("none", "group_mean")}, lambda algo: algo.baseline == "group_mean"
    ),
    "ppo": Estimator(ppo_advantages, {}, lambda algo: False),
}
# Estimators that take turn-level credit (algo.turn_discount): those whose baseline is the prompt group's.
TURN_CREDIT_ESTIMATORS = ("grpo", "rloo")
# Options that belong to some estimators only; the others must leave them null.
ESTIMATOR_OPTIONS = tuple(sorted({option for e in ESTIMATORS.values() for option in e.options}))


# --------------------------------------------------------------------------------------------- the batch column
def compute_advantages(batch: RolloutBatch, algo: AlgoConfig) -> tuple[Advantages, dict[str, float]]:
    """The ``advantage`` column of a whole rollout batch (with ``old_logprobs``, and ``ref_logprobs`` when the
    reward carries a KL penalty), and metrics of what went into it."""
    rewards = np.asarray(batch.samples["reward"], dtype=np.float64)
    if not np.all(np.isfinite(rewards)):
        raise ValueError("compute_advantages got a NaN or inf reward; filter bad samples before computing advantages")
    lengths = np.asarray(batch.response_lengths())
    stats: dict[str, float] = {}
    token_rewards = None
    if algo.kl_reward_coef > 0:
        old = torch.tensor([v for lp in batch.samples["old_logprobs"] for v in lp], dtype=torch.float64)
        ref = torch.tensor([v for lp in batch.samples["ref_logprobs"] for v in lp], dtype=torch.float64)
        kl = kl_penalty(old, ref, algo.kl_estimator).numpy()
        if "loss_mask" in batch.samples:  # an episode's environment tokens are not the policy's: no penalty
            kl = kl * np.concatenate([np.asarray(m, dtype=np.float64) for m in batch.samples["loss_mask"]])
        stats["reward/kl"] = float(kl.mean()) if kl.size else 0.0
        token_rewards = np.split(-algo.kl_reward_coef * kl, np.cumsum(lengths)[:-1])
    inputs = AdvantageInputs(rewards, np.asarray(batch.samples["group_id"]), lengths, token_rewards,
                             batch.samples.get("old_values"), batch.samples.get("turn_rewards"),
                             batch.samples.get("token_turns"))
    return ESTIMATORS[algo.name].compute(inputs, algo), stats
