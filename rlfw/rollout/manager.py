"""RolloutManager: prompts from the task, completions from the engines, rewards and group advantages.

It runs as a Ray actor and owns the engine actors. Everything it returns is a ``RolloutBatch`` whose per-sample keys
the trainer reads (tokens, prompt_len, advantage, ...) and whose per-batch keys carry what logging needs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Dict, List

import numpy as np
import ray
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlfw.algo.grpo import group_advantages
from rlfw.data.batch import RolloutBatch
from rlfw.megatron.model import ModelShape
from rlfw.rollout.engines.local import LocalEngine
from rlfw.rollout.types import SamplingParams


def padded_vocab_size(tokenizer_size: int, tp: int) -> int:
    """Embedding rows: the tokenizer's size rounded up so every tensor-parallel rank holds an equal slice."""
    multiple = 8 * tp
    return ((tokenizer_size + multiple - 1) // multiple) * multiple


@ray.remote(num_cpus=0)  # orchestration only: the engines hold the CPU share
class RolloutManager:
    def __init__(self, cfg: Dict[str, Any], shape: ModelShape):
        import torch

        torch.set_num_threads(1)
        self.cfg = OmegaConf.create(cfg)
        self.task = instantiate(self.cfg.task)
        self.shape = shape
        tok = self.task.tokenizer
        engine_cls = ray.remote(LocalEngine)
        self.engines = [
            engine_cls.options(num_cpus=self.cfg.rollout.cpus_per_engine).remote(
                shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=self.cfg.seed * 1000 + i
            )
            for i in range(self.cfg.rollout.num_engines)
        ]
        self.weight_version = -1

    def update_weights(self, hf_state, version: int) -> float:
        """Push new policy weights to every engine; returns the seconds it took."""
        t0 = time.perf_counter()
        ray.get([e.update_weights.remote(hf_state, version) for e in self.engines])
        self.weight_version = version
        return time.perf_counter() - t0

    def generate(self, step: int, expected_version: int) -> Dict[str, Any]:
        """One rollout batch for RL step ``step``; the same step and seed give the same prompts."""
        if self.weight_version != expected_version:
            raise RuntimeError(
                f"engines hold weights v{self.weight_version} but step {step} needs v{expected_version}"
            )
        cfg = self.cfg.rollout
        rng = np.random.default_rng([self.cfg.seed, step])
        prompts = self.task.sample_prompts(cfg.num_prompts, rng)
        n = cfg.n_samples_per_prompt
        t0 = time.perf_counter()
        requests, kept_prompts, too_long = [], [], 0
        for prompt in prompts:
            budget = self.shape.max_seq_len - len(prompt.token_ids)
            if budget < 1:
                too_long += 1  # the prompt alone fills the context: it cannot be trained on
                continue
            kept_prompts.append(prompt)
            requests += [prompt.token_ids] * n
        max_new = cfg.max_new_tokens or self.task.max_response_len
        max_new = min(max_new, self.shape.max_seq_len - max((len(p.token_ids) for p in kept_prompts), default=0))
        params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=max(max_new, 1))
        shards = np.array_split(np.arange(len(requests)), len(self.engines))
        # Each shard's sampler is seeded by (run seed, step, shard): rollouts are a pure function of the step, which
        # is what lets a resumed run continue exactly where the interrupted one stopped.
        futures = [
            e.generate.remote([requests[i] for i in shard],
                              dataclasses.replace(params, seed=int(np.random.SeedSequence(
                                  [self.cfg.seed, step, k]).generate_state(1)[0])))
            for k, (e, shard) in enumerate(zip(self.engines, shards))
        ]
        generations = [g for f in ray.get(futures) for g in f]
        gen_time = time.perf_counter() - t0

        columns: Dict[str, List[Any]] = {k: [] for k in (
            "sample_id", "group_id", "tokens", "prompt_len", "reward", "rollout_logprobs", "truncated")}
        bad_groups = 0
        for g_index, prompt in enumerate(kept_prompts):
            group = generations[g_index * n:(g_index + 1) * n]
            rewards = [float(self.task.reward(prompt, gen.response_ids)) for gen in group]
            if not all(math.isfinite(r) for r in rewards):
                bad_groups += 1  # a non-finite reward poisons the group's advantage: drop the whole group
                continue
            for j, (gen, reward) in enumerate(zip(group, rewards)):
                columns["sample_id"].append(step * len(requests) + g_index * n + j)
                columns["group_id"].append(prompt.prompt_id)
                columns["tokens"].append(list(prompt.token_ids) + list(gen.response_ids))
                columns["prompt_len"].append(len(prompt.token_ids))
                columns["reward"].append(reward)
                columns["rollout_logprobs"].append(list(gen.logprobs))
                columns["truncated"].append(gen.finish_reason == "length")
        columns["advantage"] = (
            group_advantages(columns["reward"], columns["group_id"], self.cfg.algo.normalize_adv_std)
            if columns["reward"] else []
        )
        batch = RolloutBatch(columns, {"step": step})
        rewards = np.asarray(columns["reward"]) if columns["reward"] else np.zeros(0)
        zero_var = sum(
            1 for g in set(columns["group_id"])
            if np.ptp([r for r, gid in zip(columns["reward"], columns["group_id"]) if gid == g]) == 0
        )
        stats = {
            "reward/mean": float(rewards.mean()) if rewards.size else float("nan"),
            "reward/std": float(rewards.std()) if rewards.size else float("nan"),
            "rollout/num_samples": len(batch),
            "rollout/response_len": float(np.mean(batch.response_lengths())) if len(batch) else 0.0,
            "rollout/truncated_frac": float(np.mean(columns["truncated"])) if len(batch) else 0.0,
            "rollout/dropped_groups_nonfinite_reward": bad_groups,
            "rollout/dropped_prompts_too_long": too_long,
            "rollout/zero_variance_groups": zero_var,
            "time/generate": gen_time,
        }
        return {"batch": batch, "stats": stats, "examples": self._examples(batch)}

    def _examples(self, batch: RolloutBatch, count: int = 4) -> List[List[Any]]:
        tok = self.task.tokenizer
        vocab = len(tok)
        rows = []
        for i in range(min(count, len(batch))):
            tokens, p = batch.samples["tokens"][i], batch.samples["prompt_len"][i]
            decode = lambda ids: tok.decode([t for t in ids if t < vocab])  # noqa: E731
            rows.append([batch.sample_ids[i], decode(tokens[:p]), decode(tokens[p:]), batch.samples["reward"][i]])
        return rows

    def shutdown(self) -> None:
        for e in self.engines:
            ray.kill(e)
