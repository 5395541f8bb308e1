"""Choosing the algorithm from the config: every estimator composes, bad combinations fail naming the field, and
the combination in use is what the run logs."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from rlfw.algo import algo_options
from rlfw.config import ConfigError, register_configs, validate

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()


def load(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("overrides,name,estimator_options", [
    ((), "grpo", {"normalize_adv_std": True, "baseline": None}),
    (("algo=grpo", "algo.normalize_adv_std=false"), "grpo", {"normalize_adv_std": False, "baseline": None}),
    (("algo=rloo",), "rloo", {"normalize_adv_std": None, "baseline": None}),
    (("algo=reinforce_pp",), "reinforce_pp", {"normalize_adv_std": None, "baseline": "none"}),
    (("algo=reinforce_pp", "algo.baseline=group_mean"), "reinforce_pp",
     {"normalize_adv_std": None, "baseline": "group_mean"}),
])
def test_every_estimator_composes_and_validates(overrides, name, estimator_options):
    cfg = load(*overrides)
    validate(cfg)
    assert cfg.algo.name == name
    assert {k: cfg.algo[k] for k in estimator_options} == estimator_options


def test_every_loss_option_on_at_once_is_valid():
    validate(load("algo=reinforce_pp", "algo.clip_eps_high=0.28", "algo.dual_clip_c=3", "algo.kl_loss_coef=0.01",
                  "algo.kl_reward_coef=0.02", "algo.kl_estimator=k2", "algo.entropy_coef=0.001", "algo.tis_cap=2",
                  "algo.loss_agg=seq_mean_token_mean", "algo.on_nonfinite=skip"))


def test_reinforce_pp_without_a_group_baseline_needs_no_groups():
    validate(load("algo=reinforce_pp", "rollout.n_samples_per_prompt=1"))


@pytest.mark.parametrize("overrides,key", [
    (("algo.name=ppo",), "algo.name"),
    (("algo.clip_eps_low=-0.1",), "algo.clip_eps_low"),
    (("algo.clip_eps_high=-0.2",), "algo.clip_eps_high"),
    (("algo.dual_clip_c=1",), "algo.dual_clip_c"),
    (("algo.dual_clip_c=0.5",), "algo.dual_clip_c"),
    (("algo.dual_clip_c=-3",), "algo.dual_clip_c"),
    (("algo.kl_loss_coef=-0.1",), "algo.kl_loss_coef"),
    (("algo.kl_reward_coef=-0.1",), "algo.kl_reward_coef"),
    (("algo.kl_estimator=k4",), "algo.kl_estimator"),
    (("algo.entropy_coef=-0.01",), "algo.entropy_coef"),
    (("algo.tis_cap=0.5",), "algo.tis_cap"),
    (("algo.loss_agg=seq_mean_token_sum",), "algo.loss_agg"),
    (("algo.on_nonfinite=ignore",), "algo.on_nonfinite"),
    (("algo.baseline=group_mean",), "algo.baseline"),  # grpo has no baseline option
    (("algo=rloo", "algo.normalize_adv_std=true"), "algo.normalize_adv_std"),
    (("algo=reinforce_pp", "algo.normalize_adv_std=false"), "algo.normalize_adv_std"),
    (("algo=reinforce_pp", "algo.baseline=mean"), "algo.baseline"),
    (("algo=reinforce_pp", "algo.baseline=null"), "algo.baseline"),
    (("algo=grpo", "algo.normalize_adv_std=null"), "algo.normalize_adv_std"),
    (("algo.turn_discount=1.5",), "algo.turn_discount"),
    (("algo.turn_discount=-0.5",), "algo.turn_discount"),
    (("algo=reinforce_pp", "algo.turn_discount=0"), "algo.turn_discount"),
    (("algo=ppo", "algo.turn_discount=1"), "algo.turn_discount"),
    (("rollout.n_samples_per_prompt=1",), "rollout.n_samples_per_prompt"),
    (("algo=rloo", "rollout.n_samples_per_prompt=1"), "rollout.n_samples_per_prompt"),
    (("algo=reinforce_pp", "algo.baseline=group_mean", "rollout.n_samples_per_prompt=1"),
     "rollout.n_samples_per_prompt"),
])
def test_bad_combinations_name_the_field(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load(*overrides))


def test_the_old_kl_coef_name_is_gone():
    with pytest.raises((ConfigCompositionException, ConfigAttributeError, ConfigKeyError)) as e:
        load("algo.kl_coef=0.1")
    assert "kl_coef" in str(e.value) + str(e.value.__cause__)


def test_algo_options_lists_the_combination_in_use():
    cfg = load("algo=reinforce_pp", "algo.baseline=group_mean", "algo.kl_reward_coef=0.05", "algo.kl_estimator=k1",
               "algo.clip_eps_high=0.28")
    assert algo_options(cfg.algo) == [
        ["estimator", "reinforce_pp"], ["baseline", "group_mean"], ["loss_agg", "token_mean"],
        ["clip_eps_low", "0.2"], ["clip_eps_high", "0.28"], ["dual_clip_c", "off"], ["kl_loss_coef", "off"],
        ["kl_reward_coef", "0.05"], ["entropy_coef", "off"], ["tis_cap", "off"], ["kl_estimator", "k1"],
        ["on_nonfinite", "stop"],
    ]
    assert algo_options(load().algo)[:3] == [["estimator", "grpo"], ["normalize_adv_std", "True"],
                                             ["turn_discount", "off"]]
    assert ["turn_discount", "0.0"] in algo_options(load("algo=rloo", "algo.turn_discount=0").algo)
