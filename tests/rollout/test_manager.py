"""RolloutManager on real engine actors: dynamic sampling, truncation, per-sample timing, versions, restarts."""

import sys

import numpy as np
import pytest
import ray
from engine_helpers import compose_cfg, random_hf_state, shape_of, sigkill
from omegaconf import OmegaConf

from rlfw.rollout.manager import RolloutManager

FAST = ["rollout.num_prompts=4", "rollout.n_samples_per_prompt=4"]


def start_manager(tmp_path, *overrides, version: int = 0):
    cfg = compose_cfg(tmp_path, *FAST, *overrides)
    shape = shape_of(cfg)
    manager = RolloutManager.remote(OmegaConf.to_container(cfg, resolve=True), shape)
    ray.get(manager.update_weights.remote([ray.put(random_hf_state(shape))], version))
    return manager


def groups_of(batch):
    groups = {}
    for gid, reward in zip(batch.samples["group_id"], batch.samples["reward"]):
        groups.setdefault(gid, []).append(reward)
    return groups


def test_dynamic_sampling_keeps_only_groups_with_signal(ray_local, tmp_path):
    manager = start_manager(
        tmp_path, "task._target_=signal_tasks.HalfSignalTask", "rollout.dynamic_sampling=true",
        "rollout.max_oversample_rounds=8",
    )
    try:
        out = ray.get(manager.generate.remote(0, 0))
    finally:
        ray.get(manager.shutdown.remote())
    batch, stats = out["batch"], out["stats"]
    groups = groups_of(batch)
    assert len(groups) == 4 and all(len(r) == 4 for r in groups.values())
    assert all(np.ptp(rewards) > 0 for rewards in groups.values())
    # Every sampled prompt is accounted for: kept, dropped for equal rewards, or cut as surplus of the last round.
    dropped, surplus = stats["rollout/dynamic/dropped_zero_variance_groups"], stats["rollout/dynamic/surplus_groups"]
    assert stats["rollout/dynamic/sampled_prompts"] == 4 + dropped + surplus
    assert stats["rollout/dynamic/rounds"] >= 2 and stats["rollout/zero_variance_groups"] == 0
    assert len(set(batch.sample_ids)) == len(batch)


def test_dynamic_sampling_gives_up_after_its_rounds(ray_local, tmp_path):
    manager = start_manager(
        tmp_path, "task._target_=signal_tasks.NoSignalTask", "rollout.dynamic_sampling=true",
        "rollout.max_oversample_rounds=2",
    )
    try:
        stats = ray.get(manager.generate.remote(0, 0))["stats"]
    finally:
        ray.get(manager.shutdown.remote())
    assert stats["rollout/num_samples"] == 0
    assert stats["rollout/dynamic/rounds"] == 3
    assert stats["rollout/dynamic/dropped_zero_variance_groups"] == stats["rollout/dynamic/sampled_prompts"] == 12


def test_batch_columns_truncation_timing_and_versions(ray_local, tmp_path):
    # One new token and a task whose answer needs 4: every response runs out of length unless it is <eos>.
    manager = start_manager(
        tmp_path, "task._target_=signal_tasks.NoSignalTask", "rollout.max_new_tokens=1", "rollout.num_engines=2",
        "rollout.max_inflight_requests=3", version=4,
    )
    try:
        with pytest.raises(Exception, match="step 0: engines hold weights v4 but v5 or newer is needed"):
            ray.get(manager.generate.remote(0, 5))
        out = ray.get(manager.generate.remote(3, 4))
        again = ray.get(manager.generate.remote(3, 4))
    finally:
        ray.get(manager.shutdown.remote())
    batch, stats = out["batch"], out["stats"]
    assert len(batch) == 16 and stats["rollout/num_groups"] == 4  # without dynamic sampling nothing is dropped
    assert batch.sample_ids == list(range(3 * 16, 4 * 16))
    responses = [t[p:] for t, p in zip(batch.samples["tokens"], batch.samples["prompt_len"])]
    assert all(len(r) == 1 for r in responses)
    assert batch.samples["truncated"] == [r != [2] for r in responses]
    assert stats["rollout/truncated_frac"] == np.mean(batch.samples["truncated"])
    assert all(s > 0 for s in batch.samples["gen_seconds"])
    assert stats["rollout/gen_seconds_mean"] == pytest.approx(np.mean(batch.samples["gen_seconds"]))
    assert stats["rollout/gen_seconds_max"] == max(batch.samples["gen_seconds"])
    assert again["batch"].samples["tokens"] == batch.samples["tokens"]  # a step's rollout is a function of the step


def heavy_imports(manager) -> list[str]:
    """The modules of torch and transformers loaded in the manager's process."""
    return ray.get(manager.__ray_call__.remote(
        lambda _: sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))))


def test_killed_engine_is_replaced_then_retired_past_the_budget(ray_local, tmp_path):
    """Also: the manager that pushed weights, generated and re-created an engine never imported torch or
    transformers (their import would be most of its start, which every rollout waits for)."""
    manager = start_manager(tmp_path, "rollout.num_engines=2", "rollout.max_engine_restarts=1")
    try:
        reference = [ray.get(manager.generate.remote(step, 0))["batch"] for step in (0, 1)]
        sigkill(ray.get(manager.health.remote())[0]["pid"])
        out = ray.get(manager.generate.remote(0, 0))
        assert out["stats"]["rollout/engine_restarts"] == 1 and out["stats"]["rollout/engines_alive"] == 2
        assert out["batch"].samples["tokens"] == reference[0].samples["tokens"]  # same samples despite the death
        assert heavy_imports(manager) == []

        sigkill(ray.get(manager.health.remote())[1]["pid"])  # the budget is spent: engine 1 is retired
        out = ray.get(manager.generate.remote(1, 0))
        assert out["stats"]["rollout/engine_restarts"] == 1 and out["stats"]["rollout/engines_alive"] == 1
        assert out["batch"].samples["tokens"] == reference[1].samples["tokens"]

        sigkill(ray.get(manager.health.remote())[0]["pid"])
        with pytest.raises(Exception, match="the last serving rollout engine .* rollout.max_engine_restarts=1"):
            ray.get(manager.generate.remote(1, 0))
    finally:
        ray.get(manager.shutdown.remote())


def test_a_weight_push_reaches_a_generation_under_way(ray_local, tmp_path):
    """loop=async's overlap: the manager takes a push (its weights group) while it generates (its rollout group);
    the engine takes the weights in the middle of the call, and every token says which weights sampled it; a step
    asking for weights newer than the engines hold is refused. (Where inside one response the switch falls depends
    on timing here; the engines' own tests pin it, greedy, at a known decode step.)"""
    manager = start_manager(
        tmp_path, "rollout.num_prompts=16", "rollout.n_samples_per_prompt=8", "rollout.max_inflight_requests=8",
        "task.length=24", "rollout.temperature=1.0", version=0,
    )
    shape = shape_of(compose_cfg(tmp_path, "task.length=24"))
    try:
        reference = ray.get(manager.generate.remote(0, 0))  # no push during the call: version 0 throughout
        assert {v for versions in reference["batch"].samples["rollout_versions"] for v in versions} == {0}
        busy = ray.get(manager.busy_seconds.remote())  # the engine seconds of one whole rollout
        rollout = manager.generate.remote(1, 0)
        # A quarter of the rollout in (its first chunks of 8 requests sampled under v0, 16 chunks in all), then the
        # push: a fraction of this machine's own rollout, not a time, whatever its load.
        while ray.get(manager.busy_seconds.remote()) < 1.25 * busy:
            assert not ray.wait([rollout], timeout=0.01)[0]
        ray.get(manager.update_weights.remote([ray.put(random_hf_state(shape, seed=1))], 1), timeout=60)
        pushed_while_generating = not ray.wait([rollout], timeout=0)[0]
        batch = ray.get(rollout)["batch"]
        with pytest.raises(Exception, match="step 2: engines hold weights v1 but v2 or newer is needed"):
            ray.get(manager.generate.remote(2, 2))
    finally:
        ray.get(manager.shutdown.remote())
    assert pushed_while_generating  # the push did not queue behind the generate call
    versions = batch.samples["rollout_versions"]
    assert [len(v) for v in versions] == batch.response_lengths()
    assert versions[0][0] == 0 and versions[-1][-1] == 1  # the first chunk started under v0, the last ended under v1
    assert all(vs == sorted(vs) for vs in versions)  # a response only ever moves to newer weights


def test_a_rollout_waits_for_the_push_of_its_version(ray_local, tmp_path):
    """The driver sends a step's weights and goes on (``RolloutQueue.push``): a rollout asked for from that version
    waits in the manager until the push has landed (asked for here before the push is even sent), and a push that
    fails is the waiting rollout's error, named, instead of a wait to its deadline."""
    manager = start_manager(tmp_path, version=0)
    shape = shape_of(compose_cfg(tmp_path))
    broken = random_hf_state(shape, seed=2)
    del broken[next(iter(broken))]  # an engine refuses a state without every weight
    try:
        rollout = manager.generate.remote(1, 1, 300.0)
        ray.get(manager.update_weights.remote([ray.put(random_hf_state(shape, seed=1))], 1), timeout=120)
        versions = ray.get(rollout, timeout=120)["batch"].samples["rollout_versions"]
        failing = manager.generate.remote(2, 2, 300.0)
        manager.update_weights.remote([ray.put(broken)], 2)
        with pytest.raises(Exception, match="step 2: the push of weights v2 failed"):
            ray.get(failing, timeout=300)
    finally:
        ray.get(manager.shutdown.remote())
    assert {v for vs in versions for v in vs} == {1}


class PoisonedWeights:
    """Weights that cannot be unpacked where they arrive: the push fails in the manager before it reaches the
    engine pool."""

    def __reduce__(self):
        return int, ("poisoned weights",)


def test_a_push_that_fails_before_the_engines_is_the_rollouts_error_at_once(ray_local, tmp_path):
    """The driver does not wait for a push (``RolloutQueue.push``); when the push fails before it reaches the
    engines, the rollout that waits for those weights fails with the push's error as soon as it is known, not at
    the rollout's deadline."""
    from rlfw.rollout.queue import RolloutQueue

    manager = start_manager(tmp_path, version=0)
    queue = RolloutQueue(manager, max_staleness=0, num_steps=4, timeout_s=600)
    try:
        queue.push(PoisonedWeights, 1)  # returns at once
        queue.fill(1, 1)
        with pytest.raises(Exception, match="poisoned weights") as failure:
            queue.take(1)
        assert "did not finish within" not in str(failure.value)
    finally:
        ray.get(manager.shutdown.remote())
