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
    assert cfg.dp.mode == "classic" and cfg.split.name == "delayed" and cfg.rollout.backend == "local"
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
        ("dp.size=0", "dp.size"),
        ("dp.tp=3", "dp.tp"),
        ("dp.pp=2", "dp.pp"),
        ("split.how=random", "split.how"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.temperature=-1", "rollout.temperature"),
        ("algo.loss_agg=mean", "algo.loss_agg"),
        ("algo.lr=0", "algo.lr"),
        ("algo.max_tokens_per_microbatch=8", "algo.max_tokens_per_microbatch"),
        ("cluster.host=localhost", "cluster.host"),
        ("model.num_query_groups=3", "model.num_query_groups"),
        ("logger.backends=[jsonl,tensorboard]", "logger.backends"),
        ("resume=", "resume"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last"),
        ("fault.kind=kill_once", "fault.kind"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load(override))


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
