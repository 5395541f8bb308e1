"""The rollout keys' validation: each bad value fails before Ray starts, naming the key."""

import pytest
from engine_helpers import CONF
from hydra import compose, initialize_config_dir

from rlfw.config import ConfigError, validate


def load(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_vllm_config_is_valid_on_cpu():
    cfg = load("rollout=vllm", "rollout.dynamic_sampling=true", "rollout.max_inflight_requests=16")
    validate(cfg)
    assert cfg.rollout.backend == "vllm" and cfg.rollout.kv_cache_gb == 0.25


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.max_inflight_requests=-1"], "rollout.max_inflight_requests=-1 must be >= 0"),
        (["rollout.max_engine_restarts=-2"], "rollout.max_engine_restarts=-2 must be >= 0"),
        (["rollout.max_oversample_rounds=-1"], "rollout.max_oversample_rounds=-1 must be >= 0"),
        (["rollout.num_engines=0"], "rollout.num_engines=0 must be > 0"),
        (["rollout.dynamic_sampling=true", "rollout.n_samples_per_prompt=1", "algo=reinforce_pp"],
         "rollout.dynamic_sampling=true needs rollout.n_samples_per_prompt >= 2"),
        (["rollout=vllm", "rollout.kv_cache_gb=0"], "rollout.kv_cache_gb=0"),
        # hidden 128 over 8 heads is a head size of 16, which vLLM's CPU attention has no kernel for.
        (["rollout=vllm", "model.num_attention_heads=8"], "model.head_dim=16"),
    ],
)
def test_bad_rollout_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("+", r"\+")):
        validate(load(*overrides))
