"""Reward functions for dataset tasks: ``(prompt_text, response_text, answer) -> float``.

A task names its reward by ``_target_`` (``task.reward._target_=my_module.my_fn``); the other keys of that node are
keyword arguments bound to the function. Built in: ``math_reward`` (math-verify equivalence of the final answer)
and ``exact_match_reward`` (string equality, optionally of an answer extracted by a regex).
"""

from rlfw.rollout.rewards.exact_match import exact_match_reward
from rlfw.rollout.rewards.math_answer import math_reward
from rlfw.rollout.rewards.target import Reward, RewardError, load_reward

__all__ = ["Reward", "RewardError", "exact_match_reward", "load_reward", "math_reward"]
