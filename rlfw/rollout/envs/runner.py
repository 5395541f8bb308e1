"""Episodes driven turn by turn: every episode of a step that is still going takes its next turn in one call to
the engine pool, then the environment answers each (several at once, in threads, when it allows it).

The episodes live here, in the rollout manager, never in an engine: an engine that dies mid-turn costs only that
turn, which the pool sends to another engine with the same seed (``EnginePool.generate``), so the episode goes on
from its last completed turn and samples what it would have sampled. A turn's seed is a function of the step's
seed and the turn's index, so a seeded step samples the same episodes whichever engines serve it. Turn 0 uses the
step's own seed and token limit: a one-turn environment samples exactly what the single-turn rollout did.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rlfw.rollout.envs.base import Done, Environment, Observation
from rlfw.rollout.envs.episode import Episode
from rlfw.rollout.types import Prompt, SamplingParams


def turn_seed(seed: int, turn: int) -> int:
    return seed if turn == 0 else int(np.random.SeedSequence([seed, turn]).generate_state(1)[0])


def run_episodes(
    env: Environment, pool, prompts: list[Prompt], n: int, params: SamplingParams, min_version: int | None,
    max_seq_len: int, reward_value: Callable[[object], float],
) -> tuple[list[Episode], float]:
    """``n`` episodes per prompt, in order, run to their end; and the seconds the environment took to answer.
    ``params``: the sampling of every turn, its ``max_new_tokens`` the turn's token limit and its seed the step's.
    ``reward_value`` checks a reward (and names the environment when it is not a number)."""
    episodes = [Episode(prompt, env.start(prompt)) for prompt in prompts for _ in range(n)]
    active = list(episodes)
    env_seconds, turn = 0.0, 0
    workers = max(1, getattr(env, "concurrency", 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env-step") as threads:
        while active:
            for episode in [e for e in active if len(e.tokens) >= max_seq_len]:  # no room for one more token
                episode.finish(reward_value(env.cut_off(episode)), "token_limit")
            active = [e for e in active if e.end is None]
            if not active:
                break
            room = max_seq_len - max(len(e.tokens) for e in active)
            turn_params = dataclasses.replace(params, max_new_tokens=max(1, min(params.max_new_tokens, room)),
                                              seed=None if params.seed is None else turn_seed(params.seed, turn))
            for episode, generation in zip(active, pool.generate([e.tokens for e in active], turn_params,
                                                                 min_version)):
                episode.add_turn(generation)
            t0 = time.perf_counter()
            answers = list(threads.map(env.step, active)) if workers > 1 else [env.step(e) for e in active]
            env_seconds += time.perf_counter() - t0
            for episode, answer in zip(active, answers):
                apply_answer(env, episode, answer, max_seq_len, reward_value)
            active = [e for e in active if e.end is None]
            turn += 1
    return episodes, env_seconds


def apply_answer(env: Environment, episode: Episode, answer, max_seq_len: int, reward_value) -> None:
    """End ``episode`` (done, or cut off by the turn or token limit) or append the environment's answer; the
    reward an answer carries is the turn's."""
    if isinstance(answer, Done):
        episode.finish(reward_value(answer.reward), "done")
        return
    if not isinstance(answer, Observation):
        raise TypeError(f"environment {type(env).__name__}.step returned {type(answer).__name__}; it must return "
                        "an Observation or Done")
    episode.credit(reward_value(answer.reward))
    if episode.turns >= env.max_turns:
        episode.finish(reward_value(env.cut_off(episode)), "turn_limit")
    elif len(episode.tokens) + len(answer.token_ids) >= max_seq_len:  # the answer leaves the policy no token
        episode.finish(reward_value(env.cut_off(episode)), "token_limit")
    else:
        episode.add_observation(list(answer.token_ids))


def episode_stats(episodes: list[Episode], env_seconds: float, generate_seconds: float) -> dict[str, float]:
    """Per-step metrics of the episodes (``env/...``): turns, truncations by cause, the mean reward of each turn,
    tool calls and errors per tool, tool seconds, and the environment's share of the rollout's wall time."""
    if not episodes:
        return {}
    turns = np.asarray([e.turns for e in episodes])
    stats = {
        "env/turns_mean": float(turns.mean()),
        "env/turns_max": float(turns.max()),
        "env/truncated_episodes": sum(e.truncated for e in episodes),
        "env/turn_limit_episodes": sum(e.end == "turn_limit" for e in episodes),
        "env/token_limit_episodes": sum(e.end == "token_limit" for e in episodes),
        "env/partial_rollout_episodes": sum(e.partial for e in episodes),
        "env/seconds": env_seconds,
        "env/share": env_seconds / generate_seconds if generate_seconds > 0 else 0.0,
    }
    for turn in range(int(turns.max())):  # what each turn earns, over the episodes that took it
        earned = [e.turn_rewards[turn] for e in episodes if len(e.turn_rewards) > turn]
        stats[f"env/turn_reward/{turn}"] = float(np.mean(earned))
    records = [r for e in episodes for r in e.tools]
    if records:
        stats["env/tool_seconds"] = float(sum(r.seconds for r in records))
        for name in sorted({r.name for r in records}):
            stats[f"env/tool_calls/{name}"] = sum(r.name == name for r in records)
            stats[f"env/tool_errors/{name}"] = sum(r.name == name and r.error is not None for r in records)
    return stats
