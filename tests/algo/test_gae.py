"""GAE for PPO against values worked out by hand, the critic's targets, and the ppo config checks."""

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from rlfw.algo.advantages import AdvantageInputs, compute_advantages, ppo_advantages
from rlfw.algo.gae import explained_variance, gae, returns
from rlfw.config import ConfigError, register_configs, validate
from rlfw.config.schema import AlgoConfig
from rlfw.data.batch import RolloutBatch

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()


def ppo(gamma, lam, **kw):
    return AlgoConfig(name="ppo", gamma=gamma, gae_lambda=lam, **kw)


def test_gae_matches_hand_computed_values():
    # gamma 0.9, lambda 0.5, V = [0.5, 0.2, 0.1], reward 1 on the last token:
    # d2 = 1 - 0.1 = 0.9; d1 = 0.9*0.1 - 0.2 = -0.11; d0 = 0.9*0.2 - 0.5 = -0.32
    # A2 = 0.9; A1 = -0.11 + 0.45*0.9 = 0.295; A0 = -0.32 + 0.45*0.295 = -0.18725
    advantages = gae(np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.2, 0.1]), 0.9, 0.5)
    np.testing.assert_allclose(advantages, [-0.18725, 0.295, 0.9], rtol=0, atol=1e-12)
    assert returns([advantages], [[0.5, 0.2, 0.1]])[0] == pytest.approx([0.31275, 0.495, 1.0], abs=1e-12)


def test_gamma_lambda_one_is_return_minus_value_and_lambda_zero_is_td():
    values = np.array([0.5, 0.2, 0.1])
    np.testing.assert_allclose(gae(np.array([0.0, 0.0, 1.0]), values, 1.0, 1.0), [0.5, 0.8, 0.9], atol=1e-12)
    # lambda 0: one-step TD errors r_t + V_{t+1} - V_t
    np.testing.assert_allclose(gae(np.array([0.0, 0.0, 1.0]), values, 1.0, 0.0), [-0.3, -0.1, 0.9], atol=1e-12)


def test_ppo_estimator_puts_the_reward_on_the_last_token_and_adds_kl_rewards():
    inputs = AdvantageInputs(
        rewards=np.array([1.0, 0.0]), group_ids=np.array([0, 0]), response_lengths=np.array([3, 1]),
        token_rewards=[np.array([-0.1, 0.0, -0.2]), np.array([-0.5])], values=[[0.5, 0.2, 0.1], [0.25]],
    )
    # Sample 0 rewards [-0.1, 0, 0.8]: A_t = sum of rewards from t - V_t = [0.7 - 0.5, 0.8 - 0.2, 0.8 - 0.1].
    # Sample 1: one token of reward -0.5 and value 0.25: A = -0.75.
    advantages = ppo_advantages(inputs, ppo(1.0, 1.0))
    assert advantages[0] == pytest.approx([0.2, 0.6, 0.7], abs=1e-12)
    assert advantages[1] == pytest.approx([-0.75], abs=1e-12)
    assert all(isinstance(a, list) for a in advantages)  # per token, even for a one-token response


def test_compute_advantages_reads_the_critic_values_from_the_batch():
    batch = RolloutBatch({
        "sample_id": [0, 1], "group_id": [0, 1], "reward": [1.0, 0.0],
        "tokens": [[5, 6, 7, 8], [5, 9, 3]], "prompt_len": [2, 2],
        "old_values": [[0.5, 0.25], [0.125]],
    })
    advantages, _ = compute_advantages(batch, ppo(1.0, 0.5))
    # Sample 0: A1 = 1 - 0.25 = 0.75; A0 = (0.25 - 0.5) + 0.5 * 0.75 = 0.125. Sample 1: A = 0 - 0.125.
    assert advantages == [pytest.approx([0.125, 0.75]), pytest.approx([-0.125])]
    with pytest.raises(ValueError, match="old_values"):
        del batch.samples["old_values"]
        compute_advantages(batch, ppo(1.0, 0.5))


def test_explained_variance():
    targets = [[1.0, 2.0], [3.0]]
    assert explained_variance(targets, targets) == 1.0
    assert explained_variance([[0.0, 0.0], [0.0]], targets) == pytest.approx(0.0)  # a constant explains nothing
    # Residuals [1, 1, -1] around targets [1, 2, 3]: 1 - var([1, 1, -1]) / var([1, 2, 3]) = 1 - (8/9) / (2/3)
    assert explained_variance([[0.0, 1.0], [4.0]], targets) == pytest.approx(1 - (8 / 9) / (2 / 3))
    assert np.isnan(explained_variance([[1.0]], [[1.0]]))


def load(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_ppo_config_composes_and_validates():
    cfg = load("algo=ppo")
    validate(cfg)
    assert (cfg.algo.gamma, cfg.algo.gae_lambda, cfg.algo.critic.value_clip) == (1.0, 0.95, 0.2)
    assert cfg.algo.critic.init_from_policy is True


@pytest.mark.parametrize("overrides,key", [
    (("algo=grpo", "algo.gamma=0.9"), "algo.gamma"),
    (("algo=rloo", "algo.gae_lambda=0.9"), "algo.gae_lambda"),
    (("algo=ppo", "algo.gamma=1.5"), "algo.gamma"),
    (("algo=ppo", "algo.gae_lambda=-0.1"), "algo.gae_lambda"),
    (("algo=ppo", "algo.gamma=null"), "algo.gamma"),
    (("algo=ppo", "algo.critic.value_clip=-1"), "algo.critic.value_clip"),
    (("algo=ppo", "algo.critic.lr=0"), "algo.critic.lr"),
    (("algo=ppo", "dp=cells", "dp.num_cells=2", "algo.critic.num_replicas=3"), "algo.critic.num_replicas"),
    (("algo=grpo", "dp=cells", "fault=kill_once", "fault.role=critic"), "fault.role"),
    (("algo=ppo", "dp=cells", "fault=kill_once", "fault.role=policy"), "fault.role"),
])
def test_bad_ppo_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(load(*overrides))
