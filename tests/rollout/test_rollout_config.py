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


@pytest.mark.parametrize("overrides,num_devices,message", [
    (["rollout.weight_transport=ipc"], None, "rollout.weight_transport='ipc'"),
    (["rollout.weight_transport=device", "cluster.device=cpu"], None, "cluster.device=cpu"),
    (["rollout.weight_transport=device", "rollout=vllm", "cluster.device=cuda", "cluster.gpus_per_worker=0.5"], 1,
     "rollout.backend=vllm"),
])
def test_weights_in_gpu_memory_need_the_local_engine_on_cuda(overrides, num_devices, message):
    with pytest.raises(ConfigError, match=message):
        validate(load(*overrides), num_devices=num_devices)
    validate(load("rollout.weight_transport=device", "cluster.device=cuda", "cluster.placement=colocated",
                  "cluster.gpus_per_worker=0.5"), num_devices=1)


def test_auto_shares_weights_in_gpu_memory_only_with_the_local_engine_on_cuda_in_a_local_ray():
    from rlfw.config.devices import weights_on_device

    cuda, cpu = "cuda", "cpu"
    assert weights_on_device(load(), cuda) and not weights_on_device(load(), cpu)
    assert not weights_on_device(load("rollout=sglang"), cuda)
    assert not weights_on_device(load("cluster.address=10.0.0.1:6379"), cuda)  # engines may sit on other nodes
    assert not weights_on_device(load("rollout.weight_transport=host"), cuda)
    assert weights_on_device(load("rollout.weight_transport=device"), cuda)
