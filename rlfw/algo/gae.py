"""Generalised advantage estimation (GAE) for PPO, per response token, and the critic's targets.

A response of n tokens is an episode of n actions: token t is taken in state s_t (the prompt and tokens < t), the
sequence reward arrives with the last token, and any per-token reward (the KL penalty, ``algo.kl_reward_coef``) with
its own token. The episode ends after the last token, so V(s_n) = 0. With the critic's V(s_t):

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * A_{t+1}        (A_n = 0)
    R_t     = A_t + V(s_t)                               (the critic's regression target, the lambda-return)

The advantages stay as GAE gives them (not whitened), so the returns are recovered exactly from them and the
values the critic saw (``returns``). The estimator entry is ``ppo`` in ``rlfw.algo.advantages``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def token_rewards(reward: float, length: int, per_token: np.ndarray | None = None) -> np.ndarray:
    """The reward of each of ``length`` response tokens: ``per_token`` (or 0), plus ``reward`` on the last."""
    rewards = np.zeros(length) if per_token is None else np.array(per_token, dtype=np.float64)
    if length:
        rewards[-1] += reward
    return rewards


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """GAE advantages of one episode (``rewards`` and ``values`` per step; the state after the last is terminal)."""
    advantages = np.zeros(len(rewards))
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


def gae_advantages(
    rewards: np.ndarray, values: Sequence[Sequence[float]], per_token: list[np.ndarray] | None, gamma: float,
    lam: float,
) -> list[np.ndarray]:
    """Per sample, the GAE advantage of every response token (``rewards``: one sequence reward per sample)."""
    out = []
    for i, (reward, v) in enumerate(zip(rewards, values)):
        v = np.asarray(v, dtype=np.float64)
        out.append(gae(token_rewards(reward, len(v), None if per_token is None else per_token[i]), v, gamma, lam))
    return out


def returns(advantages: Sequence[Sequence[float]], values: Sequence[Sequence[float]]) -> list[list[float]]:
    """The critic's targets R_t = A_t + V(s_t), per sample and response token."""
    return [[float(a + v) for a, v in zip(adv, val)] for adv, val in zip(advantages, values)]


def explained_variance(values: Sequence[Sequence[float]], targets: Sequence[Sequence[float]]) -> float:
    """1 - Var(R - V) / Var(R) over every response token: 1 is a perfect critic, 0 no better than a constant,
    negative worse. NaN when the targets do not vary (nothing to explain)."""
    v = np.concatenate([np.asarray(x, dtype=np.float64) for x in values] or [np.zeros(0)])
    r = np.concatenate([np.asarray(x, dtype=np.float64) for x in targets] or [np.zeros(0)])
    if r.size == 0 or np.var(r) == 0:
        return float("nan")
    return float(1.0 - np.var(r - v) / np.var(r))
