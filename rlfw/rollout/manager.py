"""RolloutManager: prompts from the task, completions from the engines, and their rewards.

It runs as a Ray actor and owns the engine actors (through an ``EnginePool``: concurrency limit, restarts of dead
engines, the weight-version check). Everything it returns is a ``RolloutBatch`` whose per-sample keys the trainer
reads (tokens, prompt_len, reward, ...) and whose per-batch keys carry what logging needs. Advantages are computed
by the driver once the trainer's log-probs are in (``rlfw.algo.advantages`` says why).

**Dynamic sampling** (DAPO, ``rollout.dynamic_sampling``): a group whose rewards are all equal has advantage 0 for
every sample, so it costs training compute and teaches nothing. Such groups are dropped and more prompts are
sampled, for up to ``rollout.max_oversample_rounds`` more rounds, until ``rollout.num_prompts`` groups with signal
are collected (a surplus from the last round is cut off). A batch still short after the last round is trained as
it is, smaller; the metrics say how many groups were kept, dropped and cut.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlfw.data.batch import RolloutBatch
from rlfw.model.shape import ModelShape
from rlfw.rollout.engines.base import build_engine, engine_class
from rlfw.rollout.engines.pool import EnginePool
from rlfw.rollout.envs.base import as_environment
from rlfw.rollout.envs.episode import Episode
from rlfw.rollout.envs.runner import episode_stats, run_episodes
from rlfw.rollout.types import Prompt, SamplingParams

# An engine that does not answer the health check before a step in this time is replaced.
HEALTH_TIMEOUT_S = 60.0


def padded_vocab_size(tokenizer_size: int, tp: int) -> int:
    """Embedding rows: the tokenizer's size rounded up so every tensor-parallel rank holds an equal slice."""
    multiple = 8 * tp
    return ((tokenizer_size + multiple - 1) // multiple) * multiple


def reward_value(value: Any, task_cfg) -> float:
    """A reward as a float. Anything but a real number (a string, None, a tensor) is an error naming the task,
    instead of a silent conversion (``float("0.5")``) or a bare ValueError deep inside a Ray actor."""
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"the reward function of task {task_cfg.get('_target_')} returned {value!r} ({type(value).__name__}); "
            "a reward must be a real number (int, float or bool)"
        )
    return float(value)


@dataclass
class _Group:
    """The episodes of one prompt, and the step-wide position of its first one (for their sample ids)."""

    prompt: Prompt
    episodes: list[Episode]
    first_position: int

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes]


# Orchestration only: the engines hold the CPU share. Two concurrency groups, one thread each: a weight push runs
# beside a generate call (the asynchronous loop trains on one step's rollout while the next one is generated, and
# pushes the new weights into that generation); calls of one group still run one at a time, in order.
@ray.remote(num_cpus=0, concurrency_groups={"rollout": 1, "weights": 1})
class RolloutManager:
    def __init__(self, cfg: dict[str, Any], shape: ModelShape):
        self.cfg = OmegaConf.create(cfg)
        self.env = as_environment(instantiate(self.cfg.task))  # a single-turn task is a one-turn environment
        self.shape = shape
        tokenizer, rollout = self.env.tokenizer, self.cfg.rollout
        self.pool = EnginePool(
            lambda index, incarnation: build_engine(self.cfg, shape, tokenizer, index, incarnation),
            engine_class(rollout.backend).num_actors(self.cfg),
            max_inflight=rollout.max_inflight_requests,
            max_restarts=rollout.max_engine_restarts,
            call_timeout_s=rollout.engine_call_timeout_s,
        )

    @ray.method(concurrency_group="weights")
    def update_weights(self, weights: list[ray.ObjectRef], version: int) -> float:
        """Push new policy weights to every engine; returns the seconds it took. ``weights``: ``[ref]``, the object
        ref of the HF state dict (or of its shared GPU buffer) in a list, which Ray hands over as it is: the manager
        never deserialises the weights (that would cost it a copy, a serialisation and torch's import); its pool
        keeps a copy on this node for replacement engines, and each engine fetches them itself."""
        t0 = time.perf_counter()
        [ref] = weights
        self.pool.update_weights(ref, version)
        return time.perf_counter() - t0

    def health(self) -> list[dict[str, Any]]:
        """Every engine's health answer (weight version, pid, ...); dead or unresponsive engines are replaced."""
        return self.pool.health(HEALTH_TIMEOUT_S)

    def busy_seconds(self) -> float:
        """Engine seconds spent generating so far (the busy fraction's numerator)."""
        return self.pool.busy_seconds()

    @ray.method(concurrency_group="rollout")
    def generate(self, step: int, min_version: int, version_wait_s: float = 0.0) -> dict[str, Any]:
        """One rollout batch for RL step ``step``, every token from weights of version ``min_version`` or newer
        (the synchronous loop's weights do not change during the call); the same step, seed and weights give the
        same prompts and responses. ``version_wait_s``: how long to wait for a push of ``min_version`` that the
        caller sent before this call (the two run in different threads, in either order); 0 refuses at once."""
        try:
            self.pool.wait_loaded(min_version, version_wait_s)
        except RuntimeError as e:
            raise RuntimeError(f"step {step}: {e}") from e
        # A dead or hung engine is found before the step's requests go out; it is replaced in the background, and
        # the others serve meanwhile.
        answers = self.pool.health(HEALTH_TIMEOUT_S, wait=False)
        cfg = self.cfg.rollout
        rng = np.random.default_rng([self.cfg.seed, step])
        rounds = 1 + (cfg.max_oversample_rounds if cfg.dynamic_sampling else 0)
        counts = {"too_long": 0, "nonfinite": 0, "zero_variance": 0, "sampled": 0, "rounds": 0, "env_s": 0.0}
        episodes: list[Episode] = []
        kept: list[_Group] = []
        position = 0  # samples generated so far in this step
        t0 = time.perf_counter()
        for round_index in range(rounds):
            num = cfg.num_prompts if round_index == 0 else self._oversample_count(counts["sampled"], len(kept))
            prompts = self.env.sample_prompts(num, step, rng)
            counts["sampled"] += num
            counts["rounds"] += 1
            groups, generated = self._generate_groups(prompts, position, [self.cfg.seed, step, round_index], counts,
                                                      min_version)
            episodes += [e for g in groups for e in g.episodes]
            position += generated
            if cfg.dynamic_sampling:
                with_signal = [g for g in groups if np.ptp(g.rewards) > 0]
                counts["zero_variance"] += len(groups) - len(with_signal)
                groups = with_signal
            kept += groups
            if len(kept) >= cfg.num_prompts:
                break
        surplus = max(0, len(kept) - cfg.num_prompts)
        kept = kept[: cfg.num_prompts]
        gen_time = time.perf_counter() - t0

        # Sample ids are unique across steps: no step generates more than `stride` samples.
        batch = self._batch(kept, step, stride=rounds * cfg.num_prompts * cfg.n_samples_per_prompt)
        stats = self._stats(batch, counts, surplus, gen_time)
        peaks = [a["gpu_peak_gib"] for a in answers if "gpu_peak_gib" in a]
        if peaks:  # GPU engines: their peak memory in the generate calls before this step's
            stats["rollout/engine_gpu_peak_gib"] = max(peaks)
        stats.update(episode_stats(episodes, counts["env_s"], gen_time))
        return {"batch": batch, "stats": stats, "examples": self._examples(batch)}

    def _oversample_count(self, sampled: int, kept: int) -> int:
        """Prompts for the next round: the missing groups divided by the share of prompts that gave one so far,
        at most ``num_prompts`` (all of them when none has yet)."""
        num_prompts = self.cfg.rollout.num_prompts
        if kept == 0:
            return num_prompts
        return min(num_prompts, math.ceil((num_prompts - kept) * sampled / kept))

    def _generate_groups(
        self, prompts: list[Prompt], first_position: int, seed_key: list[int], counts: dict[str, int],
        min_version: int,
    ) -> tuple[list[_Group], int]:
        """``n_samples_per_prompt`` episodes per prompt (a response and its reward, for a single-turn task), and how
        many were generated; prompts that fill the context and groups with a non-finite reward are dropped (and
        counted)."""
        cfg = self.cfg.rollout
        n = cfg.n_samples_per_prompt
        fitting = []
        for prompt in prompts:
            if self.shape.max_seq_len - len(prompt.token_ids) < 1:
                counts["too_long"] += 1  # the prompt alone fills the context: it cannot be trained on
            else:
                fitting.append(prompt)
        if not fitting:
            return [], 0
        max_new = cfg.max_new_tokens or self.env.max_response_len
        max_new = min(max_new, self.shape.max_seq_len - max(len(p.token_ids) for p in fitting))
        # Rollouts are a pure function of the step (and round): what lets a resumed run continue exactly where the
        # interrupted one stopped. The pool derives each chunk's seed from this one.
        seed = int(np.random.SeedSequence(seed_key).generate_state(1)[0])
        params = SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=max(max_new, 1), seed=seed
        )
        episodes, env_s = run_episodes(
            self.env, self.pool, fitting, n, params, min_version, self.shape.max_seq_len,
            lambda value: reward_value(value, self.cfg.task))
        counts["env_s"] += env_s

        groups = []
        for index, prompt in enumerate(fitting):
            group = _Group(prompt, episodes[index * n:(index + 1) * n], first_position + index * n)
            if not all(math.isfinite(r) for r in group.rewards):
                counts["nonfinite"] += 1  # a non-finite reward poisons the group's advantage: drop the whole group
                continue
            groups.append(group)
        return groups, len(episodes)

    def _batch(self, groups: list[_Group], step: int, stride: int) -> RolloutBatch:
        columns: dict[str, list[Any]] = {k: [] for k in (
            "sample_id", "group_id", "tokens", "prompt_len", "loss_mask", "reward", "rollout_logprobs",
            "rollout_versions", "partial_rollout", "truncated", "gen_seconds", "turn_rewards", "token_turns")}
        for group in groups:
            for j, episode in enumerate(group.episodes):  # one sample per episode: the ledger's unit
                columns["sample_id"].append(step * stride + group.first_position + j)
                columns["group_id"].append(group.prompt.prompt_id)
                columns["tokens"].append(episode.tokens)
                columns["prompt_len"].append(episode.prompt_len)
                columns["loss_mask"].append(episode.loss_mask)  # per response token: 1 policy, 0 environment
                columns["reward"].append(episode.reward)
                columns["rollout_logprobs"].append(episode.logprobs)
                columns["rollout_versions"].append(episode.versions)  # the policy version of every policy token
                columns["partial_rollout"].append(episode.partial)  # weights pushed inside one of its turns
                columns["truncated"].append(episode.truncated)
                columns["gen_seconds"].append(episode.seconds)
                columns["turn_rewards"].append(episode.turn_rewards)  # the reward is their sum
                columns["token_turns"].append(episode.token_turns)  # per response token: its turn
        return RolloutBatch(columns, {"step": step})

    def _stats(self, batch: RolloutBatch, counts: dict[str, int], surplus: int, gen_time: float) -> dict[str, float]:
        columns = batch.samples
        rewards = np.asarray(columns["reward"]) if columns["reward"] else np.zeros(0)
        zero_var = sum(
            1 for g in set(columns["group_id"])
            if np.ptp([r for r, gid in zip(columns["reward"], columns["group_id"]) if gid == g]) == 0
        )
        seconds = np.asarray(columns["gen_seconds"]) if columns["gen_seconds"] else np.zeros(1)
        return {
            "reward/mean": float(rewards.mean()) if rewards.size else float("nan"),
            "reward/std": float(rewards.std()) if rewards.size else float("nan"),
            "rollout/num_samples": len(batch),
            "rollout/num_groups": len(set(columns["group_id"])),
            "rollout/response_len": float(np.mean(batch.response_lengths())) if len(batch) else 0.0,
            "rollout/truncated_frac": float(np.mean(columns["truncated"])) if len(batch) else 0.0,
            "rollout/dropped_groups_nonfinite_reward": counts["nonfinite"],
            "rollout/dropped_prompts_too_long": counts["too_long"],
            "rollout/zero_variance_groups": zero_var,
            "rollout/dynamic/dropped_zero_variance_groups": counts["zero_variance"],
            "rollout/dynamic/surplus_groups": surplus,
            "rollout/dynamic/rounds": counts["rounds"],
            "rollout/dynamic/sampled_prompts": counts["sampled"],
            "rollout/gen_seconds_mean": float(seconds.mean()),
            "rollout/gen_seconds_max": float(seconds.max()),
            "rollout/engine_restarts": self.pool.restarts,
            "rollout/engines_alive": self.pool.num_alive(),
            "rollout/weight_version": self.pool.weight_version,  # the newest; every token was checked against it
            "time/generate": gen_time,
        }

    def _examples(self, batch: RolloutBatch, count: int = 4) -> list[list[Any]]:
        tok = self.env.tokenizer
        vocab = len(tok)
        rows = []
        for i in range(min(count, len(batch))):
            tokens, p = batch.samples["tokens"][i], batch.samples["prompt_len"][i]
            decode = lambda ids: tok.decode([t for t in ids if t < vocab])
            rows.append([batch.sample_ids[i], decode(tokens[:p]), decode(tokens[p:]), batch.samples["reward"][i]])
        return rows

    def shutdown(self) -> None:
        self.env.close()
        self.pool.shutdown()
