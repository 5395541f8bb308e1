"""A step before it trains: its rollout, every role's pre-update pass, the advantages, and how it is split.

Nothing is committed here: a step whose batch cannot train is skipped (logged), or ends the run when no later
step could train either (``NothingToTrainError``, naming the limit and the key).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import ray

from rlfw.algo.advantages import compute_advantages
from rlfw.algo.nonfinite import nonfinite_advantages, verdict
from rlfw.checkpoint.partial import PartialStep
from rlfw.data.batch import EagerParts, RolloutBatch, split_batch
from rlfw.loop.roles import Role
from rlfw.rollout.queue import staleness


class NothingToTrainError(RuntimeError):
    """A step's rollout batch is empty for a reason no later step can fix (prompts too long, rewards not finite)."""


def nothing_to_train(cfg, stats: Dict[str, float], step: int) -> Optional[str]:
    """Why an empty rollout batch means the run cannot train, naming the limit and the key; None when the batch is
    empty only because dynamic sampling dropped every group without reward variance (a step that is skipped)."""
    too_long = int(stats.get("rollout/dropped_prompts_too_long", 0))
    nonfinite = int(stats.get("rollout/dropped_groups_nonfinite_reward", 0))
    if too_long:
        return (
            f"step {step}: every prompt that was sampled is dropped: {too_long} prompts fill the whole context "
            f"(model.max_seq_len={cfg.model.max_seq_len} tokens) and"
            + (f" {nonfinite} groups had a non-finite reward;" if nonfinite else " none was left;")
            + " raise model.max_seq_len or give the task shorter prompts"
        )
    if nonfinite:
        return (
            f"step {step}: the reward of every one of {nonfinite} prompt groups was NaN or infinite, so no sample "
            f"is left to train on; fix the task's reward function ({cfg.task.get('_target_')})"
        )
    return None


def plan_split(minibatches: List[RolloutBatch], split, num_replicas: int):
    """Eager: one object ref per replica and minibatch, now. Delayed: the minibatches, split at train time."""
    if split.when == "rollout":
        plans = []
        for mb in minibatches:
            parts = split_batch(mb, num_replicas, split.how, split.attention_weight)
            where = {k: mb.meta[k] for k in ("step", "minibatch_index")}
            plans.append(EagerParts([ray.put(p) for p in parts], [list(p.sample_ids) for p in parts], where))
        return plans
    return ray.put(minibatches)


def prepare_step(cfg, roles: List[Role], rollout: Dict[str, Any], loggers, step: int, version: int,
                 max_staleness: int) -> Optional[PartialStep]:
    """Step ``step``'s rollout with every role's pre-update pass (the policy's log-probs, the critic's values) and
    the advantages: the step as it will train, or None when it is skipped (logged). The trainers hold version
    ``version``: their log-probs are the proximal policy's, the engines' (``rollout_logprobs``) the behaviour
    policy's (``algo.tis_cap`` weighs one against the other)."""
    batch: RolloutBatch = rollout["batch"]
    metrics = dict(rollout["stats"])
    metrics.update(staleness(batch.samples["rollout_versions"], version, max_staleness,
                             batch.samples.get("partial_rollout")))
    if len(batch) == 0:
        cause = nothing_to_train(cfg, metrics, step)
        if cause is not None:
            raise NothingToTrainError(cause)
        loggers.event("empty_batch", step, reason="dynamic sampling kept no group with reward variance")
        loggers.log(metrics, step)
        return None
    t1 = time.perf_counter()
    for role in roles:
        role.group.await_replacements()  # (ft.await_replacement_s) before the step's split and quorum
    for role in roles:
        batch = role.pre_update(batch)
    metrics["time/logprobs"] = time.perf_counter() - t1
    batch.samples["advantage"], advantage_stats = compute_advantages(batch, cfg.algo)
    metrics.update(advantage_stats)
    for role in roles:
        metrics.update(role.targets(batch))
    bad = nonfinite_advantages(batch.samples["advantage"])
    if bad:  # under algo.on_nonfinite=stop, verdict raises
        num_minibatches = batch.num_minibatches(cfg.algo.global_batch_size)
        metrics.update(verdict(cfg.algo.on_nonfinite, step, {"advantage": num_minibatches},
                               f" in {bad} of {len(batch)} samples"))
        loggers.event("nonfinite_skip", step, quantity="advantage", samples=bad)
        loggers.log(metrics, step)
        return None
    return PartialStep(step, batch, metrics, rollout["examples"])
