"""The RL loop: generate -> log-probs -> split -> train -> sync weights -> log -> checkpoint.

Everything here runs in the driver; the heavy lifting happens in the rollout manager and the train group's actors.
A step's weight push lands in the engines while the driver logs, checkpoints and starts the next step: the rollout
that needs those weights waits for them in the manager (``RolloutQueue.push``).
``loop=async`` differs in one place: the rollout queue asks for the next ``loop.max_staleness`` steps' rollouts
before the current step trains, so they are generated meanwhile (``rlfw.rollout.queue`` says how the bound holds).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import ray

from rlfw.algo import algo_options
from rlfw.algo.advantages import compute_advantages
from rlfw.algo.gae import explained_variance, returns
from rlfw.algo.losses import old_logprobs_from_training
from rlfw.algo.nonfinite import nonfinite_advantages, skipped_steps, verdict
from rlfw.data.batch import EagerParts, RolloutBatch, split_batch
from rlfw.data.partition import strided_partition
from rlfw.checkpoint.partial import PartialStep, read_partial
from rlfw.checkpoint.resume import rewind_step_logs
from rlfw.ft.errors import BelowMinCellsError, StateLostError
from rlfw.ft.goodput import GoodputMeter
from rlfw.rollout.queue import RolloutQueue, staleness
from rlfw.run_files import LEDGER


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


def attach_logprobs(group, batch: RolloutBatch) -> RolloutBatch:
    """Recompute every sample's log-probs with the trainer (strided shares, one per replica) before any update,
    so every optimizer step of this rollout uses the same old policy."""
    parts = strided_partition(len(batch), group.replica_count())
    results = group.compute_logprobs(ray.put(batch), parts)
    for key in results[0]:
        column: List[Any] = [None] * len(batch)
        for indices, result in zip(parts, results):
            for i, values in zip(indices, result[key]):
                column[i] = values
        batch.samples[key] = column
    return batch


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


def step_metrics(results: Dict[int, List[Dict[str, Any]]], prefix: str) -> Dict[str, float]:
    """Loss and per-replica batch sizes of one RL step (``results``: replica -> committed minibatch stats)."""
    m: Dict[str, float] = {}
    sums: Dict[str, float] = {}
    num_steps = max((len(r) for r in results.values()), default=0)
    for replica, steps in results.items():
        m[f"{prefix}/{replica}/num_samples"] = sum(s["num_samples"] for s in steps)
        m[f"{prefix}/{replica}/num_tokens"] = sum(s["num_tokens"] for s in steps)
        m[f"{prefix}/{replica}/time_forward_backward"] = sum(s["time/forward_backward"] for s in steps)
        for s in steps:
            for k, v in s["sums"].items():
                sums[k] = sums.get(k, 0.0) + v
    for k, v in sums.items():  # weighted sums over minibatches -> mean per optimizer step
        m["loss" if k == "loss" else f"train/{k}"] = v / max(num_steps, 1)
    m["train/num_samples"] = sum(m[f"{prefix}/{r}/num_samples"] for r in results)
    m["train/num_tokens"] = sum(m[f"{prefix}/{r}/num_tokens"] for r in results)
    m["train/optimizer_steps"] = num_steps
    for key in ("time/quorum", "time/forward_backward", "time/reduce_and_vote",  # where a replica's step goes
                "time/state_release", "time/state_restore", "offload/released_gib",  # cluster.placement=colocated
                "gpu/train_peak_gib"):
        values = [s[key] for steps in results.values() for s in steps if key in s]
        if values:
            m[f"train/{key}"] = float(np.mean(values))
    norms = [s["grad_norm"] for steps in results.values() for s in steps if s.get("grad_norm") is not None]
    if norms:
        m["train/grad_norm"] = float(np.mean(norms))
    # |proximal - behaviour| log-prob per token, weighed as the loss weighs tokens (policy_loss's diagnostic)
    m["rollout/logprob_abs_diff"] = m.pop("train/logprob_abs_diff", 0.0)
    return m


def train_critic(cfg, critic, batch: RolloutBatch, minibatches: List[RolloutBatch], step: int, record: Dict,
                 done_ids: List[int]):
    """PPO: train the critic on the same minibatches as the policy (targets ``returns``, clipped around
    ``old_values``), check its accounting and replicas like the policy's (digests into the ledger ``record``);
    returns its metrics. ``done_ids``: samples it trained in this step before a save (a resumed step)."""
    results = critic.train(plan_split(minibatches, cfg.split, len(critic.replica_ids())))
    check_exactly_once(batch, done_ids + trained_sample_ids(results))
    if cfg.ft.verify_weights_every and step % cfg.ft.verify_weights_every == 0:
        record["critic_weight_digests"] = verify_replicas_equal(critic, step)
    m: Dict[str, float] = {}
    num_steps = max((len(r) for r in results.values()), default=0)
    sums: Dict[str, float] = {}
    for replica, steps in results.items():
        m[f"{critic.metric_prefix}/{replica}/num_samples"] = sum(s["num_samples"] for s in steps)
        m[f"{critic.metric_prefix}/{replica}/num_tokens"] = sum(s["num_tokens"] for s in steps)
        for s in steps:
            for k, v in s["sums"].items():
                sums[k] = sums.get(k, 0.0) + v
    m["critic/loss"] = sums.get("loss", 0.0) / max(num_steps, 1)
    m["critic/value_clip_frac"] = sums.get("value_clip_frac", 0.0) / max(num_steps, 1)
    norms = [s["grad_norm"] for steps in results.values() for s in steps if s.get("grad_norm") is not None]
    if norms:
        m["critic/grad_norm"] = float(np.mean(norms))
    skipped = skipped_steps(results)
    m.update({f"critic/{k}": v for k, v in verdict(cfg.algo.on_nonfinite, step, skipped).items()})
    m.update({f"critic/{k}": v for k, v in critic.step_info().items()})
    return m


def trained_sample_ids(results: Dict[int, List[Dict[str, Any]]]) -> List[int]:
    """The sample ids trained in committed optimizer steps, from what the surviving replicas report.

    A replica that died after contributing to a committed step reports nothing; its share is known from any
    survivor of that step (``participant_ids``: every participant's part, which they all agreed on). Every report
    of one minibatch must name the same commit (quorum id, torchft step, participants): two commits of one
    minibatch would be a fork, replicas that trained it apart.
    """
    per_minibatch: Dict[int, List[int]] = {}
    commits: Dict[int, tuple] = {}
    own: Dict[int, List[int]] = {}
    for replica, steps in results.items():
        for s in steps:
            mb = s["minibatch_index"]
            own.setdefault(mb, []).extend(s["sample_ids"])
            commit = (s.get("quorum_id"), s.get("ft_step"), s.get("num_replicas"))
            if commits.setdefault(mb, commit) != commit:
                raise RuntimeError(f"minibatch {mb} was committed twice: (quorum id, torchft step, participants) "
                                   f"{commits[mb]} vs {commit} of replica {replica}")
            if s.get("participant_ids") is not None:
                ids = [i for p in s["participant_ids"] for i in p]
                if mb in per_minibatch and sorted(per_minibatch[mb]) != sorted(ids):
                    raise RuntimeError(f"replicas report different participant shares for minibatch {mb}")
                per_minibatch[mb] = ids
    return [i for mb in sorted(own) for i in per_minibatch.get(mb, own[mb])]


def check_exactly_once(batch: RolloutBatch, trained_ids: List[int]) -> None:
    """Every sample of the rollout batch trained exactly once in a committed step, or a loud error."""
    if sorted(trained_ids) != sorted(batch.sample_ids):
        missing = set(batch.sample_ids) - set(trained_ids)
        twice = len(trained_ids) - len(set(trained_ids))
        unknown = set(trained_ids) - set(batch.sample_ids)
        raise RuntimeError(
            f"sample accounting failed: {len(missing)} samples never trained, {twice} trained more than once, "
            f"{len(unknown)} not in the rollout batch"
        )


def verify_replicas_equal(group, step: int) -> Dict[str, str]:
    """Every replica's weights must be bitwise equal after a committed step; a difference stops the run."""
    digests = group.weights_digests()
    digests = dict(enumerate(digests)) if isinstance(digests, list) else digests
    if len(set(digests.values())) > 1:
        raise RuntimeError(f"step {step}: replicas hold different weights: {digests}")
    return {str(k): v for k, v in digests.items()}


def max_staleness(cfg) -> int:
    """How many policy versions a sample may lag behind the weights that train on it (0: the synchronous loop)."""
    return cfg.loop.max_staleness if cfg.loop.mode == "async" else 0


def prepare_step(cfg, group, critic, queue: RolloutQueue, loggers, step: int, version: int) -> Optional[PartialStep]:
    """Take step ``step``'s rollout, attach the trainers' log-probs (and the critic's values) and the advantages:
    the step as it will train (nothing committed yet), or None when the step is skipped (logged). The trainers hold
    version ``version``: their log-probs are the proximal policy's, the engines' (``rollout_logprobs``) the
    behaviour policy's (``algo.tis_cap`` weighs one against the other). With one optimizer step per rollout the
    training forward computes the proximal log-probs itself, and no pass runs here (``old_logprobs_from_training``)."""
    rollout = queue.take(step)
    batch: RolloutBatch = rollout["batch"]
    metrics = dict(rollout["stats"])
    metrics.update(staleness(batch.samples["rollout_versions"], version, max_staleness(cfg),
                             batch.samples.get("partial_rollout")))
    if len(batch) == 0:
        cause = nothing_to_train(cfg, metrics, step)
        if cause is not None:
            raise NothingToTrainError(cause)
        loggers.event("empty_batch", step, reason="dynamic sampling kept no group with reward variance")
        loggers.log(metrics, step)
        return None
    t1 = time.perf_counter()
    for source in [s for s in (group, critic) if s is not None]:
        source.await_replacements()  # (ft.await_replacement_s) before the step's split and quorum
    if not old_logprobs_from_training(cfg.algo, batch.num_minibatches(cfg.algo.global_batch_size)):
        batch = attach_logprobs(group, batch)
    if critic is not None:  # the critic's pre-update phase attaches its values (old_values) the same way
        batch = attach_logprobs(critic, batch)
    metrics["time/logprobs"] = time.perf_counter() - t1
    batch.samples["advantage"], advantage_stats = compute_advantages(batch, cfg.algo)
    metrics.update(advantage_stats)
    if critic is not None:
        batch.samples["returns"] = returns(batch.samples["advantage"], batch.samples["old_values"])
        metrics["critic/explained_variance"] = explained_variance(batch.samples["old_values"], batch.samples["returns"])
    bad = nonfinite_advantages(batch.samples["advantage"])
    if bad:  # under algo.on_nonfinite=stop, verdict raises
        num_minibatches = batch.num_minibatches(cfg.algo.global_batch_size)
        metrics.update(verdict(cfg.algo.on_nonfinite, step, {"advantage": num_minibatches},
                               f" in {bad} of {len(batch)} samples"))
        loggers.event("nonfinite_skip", step, quantity="advantage", samples=bad)
        loggers.log(metrics, step)
        return None
    return PartialStep(step, batch, metrics, rollout["examples"])


def log_events(loggers, meter: GoodputMeter, step: int, events, role: Optional[str] = None) -> None:
    """Log a train group's events at step ``step``; a failure among them starts the meter's MTTR clock."""
    for event in events:
        if event["kind"] == "cell_failed":
            meter.failure(event["detected_at"])
        loggers.event(event.pop("kind"), step, **({"role": role} if role else {}), **event)


def restore_last_state(cfg, group, critic, loggers, meter: GoodputMeter, run_dir: Path, checkpointer, step: int,
                       error: Exception):
    """Every cell holding the trained state died in step ``step``: what a restarted job would do, in this one. The
    cells start afresh from the newest checkpoint (or the job's own start), the step logs of the steps to redo are
    rewound (as ``resume`` does), and the event ``state_restored`` says so. Returns (the step to go on from, the
    interrupted step that checkpoint holds, if it was taken inside one)."""
    point = checkpointer.last_state()
    to_step = point.step if point is not None else 0
    sources = [(source, role) for source, role in ((group, None), (critic, "critic")) if source is not None]
    drained = [(source.drain_events(), role) for source, role in sources]
    loggers.reopen_files()
    rewound = rewind_step_logs(run_dir, to_step)
    meter.rewind(to_step)
    for events, role in drained:  # the failures that led here, logged after the rewind: they stay in the record
        log_events(loggers, meter, step, events, role)
    for source, _ in sources:
        source.restore(str(point.path) if point is not None else None)
    loggers.event("state_restored", step, restored_step=to_step, reason=str(error)[:300],
                  checkpoint=str(point.path) if point is not None else None, rewound=rewound)
    return to_step, read_partial(point.path) if point is not None else None


def train_step(cfg, group, critic, queue: RolloutQueue, loggers, meter: GoodputMeter, ledger, checkpointer,
               current: PartialStep, t0: float, started: float, version: int) -> Dict[str, float]:
    """Train the prepared step ``current`` on every replica (the critic too), check that every sample trained
    exactly once, record it in the ledger, send the new weights (version ``version + 1``), log, checkpoint."""
    step = current.step
    batch, metrics, examples = current.batch, dict(current.metrics), current.examples
    minibatches = batch.minibatches(cfg.algo.global_batch_size)
    t2 = time.perf_counter()
    results = group.train(plan_split(minibatches, cfg.split, len(group.replica_ids())))
    critic_record: Dict[str, Any] = {}
    if critic is not None:
        metrics.update(train_critic(cfg, critic, batch, minibatches, step, critic_record,
                                    current.done_sample_ids("critic", minibatches)))
        log_events(loggers, meter, step, critic.drain_events(), "critic")
    t3 = time.perf_counter()
    trained = current.done_sample_ids("actor", minibatches) + trained_sample_ids(results)
    check_exactly_once(batch, trained)
    current.complete = True  # every minibatch is committed: a save from here on is between steps
    record = {"step": step, "sample_ids": sorted(trained)}
    if cfg.ft.verify_weights_every and step % cfg.ft.verify_weights_every == 0:
        t_verify = time.perf_counter()
        record["weight_digests"] = verify_replicas_equal(group, step)
        metrics["time/verify_weights"] = time.perf_counter() - t_verify
    ledger.write(json.dumps({**record, **critic_record}) + "\n")
    metrics.update(queue.push(group.export_weights(), version + 1))  # lands while the driver goes on
    metrics.update(step_metrics(results, group.metric_prefix))
    metrics.update(group.step_info())
    log_events(loggers, meter, step, group.drain_events())
    metrics.update({"time/train": t3 - t2, "time/step": time.perf_counter() - t0,
                    "time/elapsed": time.time() - started})
    metrics.update(queue.utilisation(metrics.get("time/logprobs", 0.0) + metrics["time/train"],
                                     int(metrics.get("rollout/engines_alive", 1))))
    metrics.update(meter.committed(step, metrics["time/step"], metrics["train/num_samples"]))
    skipped = skipped_steps(results)
    metrics.update(verdict(cfg.algo.on_nonfinite, step, skipped))
    for quantity, count in skipped.items():
        loggers.event("nonfinite_skip", step, quantity=quantity, optimizer_steps=count)
    loggers.log(metrics, step)
    if step % 10 == 0:
        loggers.table("generations", ["sample_id", "prompt", "response", "reward"], examples, step)
    if checkpointer is not None:
        checkpointer.maybe_save(step, final=step == cfg.num_steps - 1)
    return metrics


def run_loop(
    cfg, group, manager, loggers, run_dir: Path, checkpointer=None, started: Optional[float] = None,
    start_step: int = 0, critic=None, resumed: Optional[PartialStep] = None, meter: Optional[GoodputMeter] = None,
) -> Dict[str, float]:
    """Steps ``start_step`` .. ``num_steps - 1`` (a resumed run starts past the steps its checkpoint holds).
    ``critic``: PPO's value-model group (None for critic-free estimators); the checkpointer saves it too.
    ``resumed``: the step a save below ft.min_cells interrupted; it is finished first, on its saved batch.
    ``meter``: the run's goodput meter (a resumed run's holds the earlier jobs' kept steps)."""
    started = started if started is not None else time.time()
    meter = meter if meter is not None else GoodputMeter(started)
    version = start_step  # the weight version counts committed RL steps
    queue = RolloutQueue(manager, max_staleness(cfg), cfg.num_steps, cfg.rollout.step_timeout_s)
    queue.push(group.export_weights(), version, wait=True)
    ledger = open(run_dir / LEDGER, "a", buffering=1)  # per step: trained sample ids, weight digests
    loggers.table("algo", ["option", "value"], algo_options(cfg.algo), start_step)  # the combination in use
    metrics: Dict[str, float] = {}
    step, next_step, restores = start_step, start_step, 0
    current: Optional[PartialStep] = None  # the step under way: what a save below ft.min_cells keeps
    try:
        while next_step < cfg.num_steps:
            step, next_step = next_step, next_step + 1
            t0 = time.perf_counter()
            try:
                if resumed is not None and resumed.step == step:
                    current = resumed
                else:
                    queue.fill(step, version)  # this step's rollout, and the next ones' in loop=async
                    current = prepare_step(cfg, group, critic, queue, loggers, step, version)
                    if current is None:
                        continue
                metrics = train_step(cfg, group, critic, queue, loggers, meter, ledger, checkpointer,
                                     current, t0, started, version)
            except StateLostError as e:  # nobody holds the trained state: the last checkpoint does
                if checkpointer is None or restores >= cfg.ft.max_state_restores:
                    raise
                restores += 1
                queue.drain()  # rollouts asked for from newer weights than those restored
                ledger.close()
                next_step, resumed = restore_last_state(cfg, group, critic, loggers, meter, run_dir, checkpointer,
                                                        step, e)
                ledger = open(run_dir / LEDGER, "a", buffering=1)
                version = next_step
                queue.push(group.export_weights(), version, wait=True)  # before any rollout asks for them
                current = None
                continue
            current = None
            version += 1
        queue.settle()  # the last push: its error, if any, is the run's
    except BelowMinCellsError as e:
        for source, role in ((group, None), (critic, "critic")):  # the failures that led here, logged
            if source is not None:
                log_events(loggers, meter, step, source.drain_events(), role)
        if checkpointer is None:
            raise
        steps_done = step
        if current is not None and current.complete:  # the step is committed: a save after it
            current, steps_done = None, step + 1
        if current is not None:  # the survivors may be inside the step: the save says how far they got
            current.done = {"actor": group.minibatches_committed(step)}
            if critic is not None:
                current.done["critic"] = critic.minibatches_committed(step)
            if not any(current.done.values()):
                current = None  # nothing of the step committed: a save between steps
        path = checkpointer.save_now(steps_done, partial=current)
        held = f" and {current.done} minibatches of step {step}" if current is not None else ""
        raise BelowMinCellsError(f"{e}; the trained state of {steps_done} steps{held} is saved in {path}") from e
    finally:
        ledger.close()
    return metrics
