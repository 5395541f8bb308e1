"""Config composition and validation: every mistake fails before Ray starts, naming the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from rlfw.config import ConfigError, register_configs, validate

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()


def load(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_config_is_valid():
    cfg = load()
    validate(cfg)
    assert cfg.dp.mode == "cells" and cfg.dp.num_cells == 2  # what rlfw is for is what a first run shows
    assert cfg.split.name == "delayed" and cfg.rollout.backend == "local"
    assert cfg.task._target_ == "rlfw.rollout.tasks.copy.CopyTask"


@pytest.mark.parametrize("split,when,how", [("eager", "rollout", "strided"), ("delayed", "train", "strided"),
                                            ("balanced", "train", "balanced")])
def test_split_presets_are_two_knobs(split, when, how):
    cfg = load(f"split={split}")
    assert (cfg.split.when, cfg.split.how) == (when, how)


def test_split_knobs_mix():
    cfg = load("split=eager", "split.how=balanced")
    validate(cfg)
    assert (cfg.split.when, cfg.split.how) == ("rollout", "balanced")


def test_num_steps_override():
    assert load("num_steps=7").num_steps == 7


def test_unknown_key_is_named():
    with pytest.raises((ConfigCompositionException, ConfigAttributeError, ConfigKeyError)) as e:
        load("algo.lrr=0.1")
    assert "lrr" in str(e.value) + str(e.value.__cause__)


def test_wrong_type_is_named():
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        load("rollout.num_prompts=many")
    assert "num_prompts" in str(e.value) + str(e.value.__cause__)


def test_unknown_group_option():
    with pytest.raises(ConfigCompositionException) as e:
        load("dp=ring")
    assert "dp" in str(e.value)


@pytest.mark.parametrize(
    "override,key",
    [
        ("dp=classic dp.size=0", "dp.size"),
        ("dp.tp=3", "dp.tp"),
        ("dp.pp=2", "dp.pp"),
        ("split.how=random", "split.how"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.temperature=-1", "rollout.temperature"),
        ("algo.loss_agg=mean", "algo.loss_agg"),
        ("algo.lr=0", "algo.lr"),
        ("algo.max_tokens_per_microbatch=8", "algo.max_tokens_per_microbatch"),
        ("algo.head_chunk_tokens=0", "algo.head_chunk_tokens"),
        ("algo.old_logprobs=never", "algo.old_logprobs"),
        ("cluster.host=0.0.0.0", "cluster.host"),
        ("cluster.host=::", "cluster.host"),
        ("cluster.host=10.0.0.0/33", "cluster.host"),
        ("cluster.host=no/such/rule", "cluster.host"),
        ("model.num_query_groups=3", "model.num_query_groups"),
        ("model.recompute=some", "model.recompute"),
        ("model.recompute=selective model.recompute_modules=[mlp,layernorm]", "model.recompute_modules"),
        ("model.recompute=selective model.recompute_modules=[]", "model.recompute_modules"),
        ("logger.backends=[jsonl,tensorboard]", "logger.backends"),
        ("resume=", "resume"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
        ("dp=classic fault.kind=kill_once fault.phase=heal_send", "fault.phase"),
        ("dp=classic fault.kind=kill_once fault.cell=2", "fault.cell"),
        ("dp.num_cells=2 ft.min_cells=3", "ft.min_cells"),
        ("ft.host_transport=tcp", "ft.host_transport"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load(*override.split()))


def test_too_many_ranks_for_the_gpus():
    with pytest.raises(ConfigError, match="dp.num_cells=4 x dp.tp=2"):
        validate(load("dp=cells", "dp.num_cells=4", "dp.tp=2"), num_devices=4)


def test_unreachable_cluster_address_fails_at_once():
    import socket

    from rlfw.cluster.ray_cluster import check_reachable

    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ConnectionError, match=f"cluster.address=127.0.0.1:{port} is unreachable"):
            check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="not host:port"):
        check_reachable("nonsense")


def _train_without_ray(monkeypatch, tmp_path, *overrides):
    """``train()`` on a composed config, with Ray's start replaced by a failure: what it raises came first."""
    import rlfw.cluster.ray_cluster as ray_cluster
    from rlfw.train import train

    def refuse(cluster):
        raise AssertionError("Ray was started before the config error was found")

    monkeypatch.setattr(ray_cluster, "start_ray", refuse)
    train(load(f"run_dir={tmp_path}", *overrides), tmp_path)


def test_bad_task_target_fails_before_ray(monkeypatch, tmp_path):
    with pytest.raises(Exception, match="nonexistent"):
        _train_without_ray(monkeypatch, tmp_path, "task._target_=rlfw.rollout.tasks.nonexistent.Task")


def test_bad_value_fails_before_ray(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="rollout.top_p"):
        _train_without_ray(monkeypatch, tmp_path, "rollout.top_p=0")


def test_schema_nodes_are_not_offered_as_group_options():
    with pytest.raises(Exception) as e:
        load("split=bogus")
    options = str(e.value).split("Available options in 'split':")[1].split("Config search path")[0]
    assert options.split() == ["balanced", "delayed", "eager"]


@pytest.mark.parametrize("content,message", [
    (None, r"dataset file .*data.jsonl does not exist \(task.data_path\)"),
    ("", r"data.jsonl holds no records"),
    ('{"answer": "4"}\n', r"record 0 has no field 'question' \(its fields: \['answer'\]\)"),
])
def test_a_dataset_that_cannot_be_read_is_a_config_error_naming_the_file(monkeypatch, tmp_path, content, message):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
    from chat_tokenizer import build_chat_tokenizer

    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_text(content)
    with pytest.raises(ConfigError, match=r"DatasetTask could not be built: .*" + message):
        _train_without_ray(monkeypatch, tmp_path, "task=gsm8k", f"task.data_path={data}",
                           f"task.tokenizer_path={build_chat_tokenizer(tmp_path / 'tokenizer')}")


def test_cuda_without_a_gpu_fails_before_ray_naming_the_key(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # what a machine without a GPU reports
    with pytest.raises(ConfigError, match=r"cluster\.device=cuda but this machine has no GPU .*device_count\(\)=0"):
        _train_without_ray(monkeypatch, tmp_path, "cluster.device=cuda")


def test_cuda_on_a_cluster_without_gpus_names_the_key():
    from rlfw.config.devices import cluster_gpus

    cfg = load("cluster.device=cuda", "cluster.address=10.0.0.1:6379")
    with pytest.raises(ConfigError, match=r"cluster\.device=cuda but the Ray cluster at .* reports no GPU"):
        cluster_gpus(cfg, {"CPU": 64.0, "memory": 1e11})
    assert cluster_gpus(cfg, {"CPU": 64.0, "GPU": 8.0}) == 8
    assert cluster_gpus(load("cluster.device=cpu"), {"GPU": 8.0}) is None


def test_separate_engines_need_gpus_of_their_own():
    cfg = load("dp.num_cells=2", "rollout.num_engines=1")
    with pytest.raises(ConfigError, match=r"cluster\.placement=separate: 2 GPUs .* need 3 GPUs but 2"):
        validate(cfg, num_devices=2)
    validate(load("dp.num_cells=2", "cluster.placement=colocated"), num_devices=2)
