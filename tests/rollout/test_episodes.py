"""Multi-turn episodes through the RolloutManager on real engines: one sample per episode with its loss mask, and
an engine SIGKILLed in the middle of the episodes loses none of them (the turn under way is regenerated, with its
seed, on the engine that replaces it)."""

import ray
from engine_helpers import compose_cfg, random_hf_state
from omegaconf import OmegaConf

from rlfw.rollout.envs.calc import CalcEnv
from rlfw.rollout.manager import RolloutManager, padded_vocab_size
from rlfw.train_group.worker import model_shape


def test_an_engine_killed_mid_episode_loses_nothing_and_the_turn_is_regenerated(ray_local, tmp_path):
    kill_file = tmp_path / "engine.pid"
    cfg = compose_cfg(tmp_path, "task=calc", "task._target_=two_turn_envs.EngineKillingCalcEnv",
                      f"+task.kill_file={kill_file}", "rollout.num_engines=2", "rollout.num_prompts=4",
                      "rollout.n_samples_per_prompt=4")
    tokenizer = CalcEnv({}).tokenizer
    shape = model_shape(cfg, padded_vocab_size(len(tokenizer), 1))
    manager = RolloutManager.remote(OmegaConf.to_container(cfg, resolve=True), shape)
    try:
        ray.get(manager.update_weights.remote([ray.put(random_hf_state(shape))], 0))
        victim = ray.get(manager.health.remote())[0]["pid"]
        kill_file.write_text(str(victim))
        killed = ray.get(manager.generate.remote(0, 0))
        assert kill_file.with_suffix(".taken").exists()
        calm = ray.get(manager.generate.remote(0, 0))  # the same step, seed and weights, no kill
        pids = [h["pid"] for h in ray.get(manager.health.remote())]
    finally:
        ray.get(manager.shutdown.remote())
    assert victim not in pids and killed["stats"]["rollout/engine_restarts"] == 1
    batch, stats = killed["batch"], killed["stats"]
    assert batch.sample_ids == list(range(16))  # every episode, once: one sample each
    for key in ("tokens", "loss_mask", "rollout_logprobs", "rollout_versions", "reward"):
        assert batch.samples[key] == calm["batch"].samples[key], key  # what an engine that lived sampled
    assert stats["env/turns_mean"] >= 2.0 and stats["env/truncated_episodes"] == sum(batch.samples["truncated"])
    arrow, equals = tokenizer.convert_tokens_to_ids(["->", "="])
    for tokens, p, mask, logprobs, versions in zip(*(batch.samples[k] for k in (
            "tokens", "prompt_len", "loss_mask", "rollout_logprobs", "rollout_versions"))):
        response = tokens[p:]
        assert len(mask) == len(logprobs) == len(response) and mask[0] == 1.0
        # The environment's tokens (context only) are exactly its observations, "-> ... =", after a turn of the
        # policy's own (trained, with log-probs and versions).
        starts = [i for i in range(1, len(mask)) if mask[i] == 0 and mask[i - 1] == 1]
        ends = [i for i in range(len(mask) - 1) if mask[i] == 0 and mask[i + 1] == 1]
        assert len(starts) >= 1 and len(starts) == len(ends)
        assert all(response[i] == arrow for i in starts) and all(response[i] == equals for i in ends)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
        assert len(versions) == sum(mask) and set(versions) == {0}
