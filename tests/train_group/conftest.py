from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rlfw.config import register_configs

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()


@pytest.fixture
def make_group(shared_ray, tmp_path):
    """``make_group(*overrides)``: the train group ``rlfw.train`` builds for the default config with ``overrides``
    (run_dir in the test's tmp_path), and its config; every group made is shut down after the test."""
    from rlfw.rollout.manager import padded_vocab_size
    from rlfw.rollout.tasks import CopyTask
    from rlfw.train import build_group

    groups = []

    def make(*overrides):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*overrides, f"run_dir={tmp_path}"])
        groups.append(build_group(cfg, padded_vocab_size(len(CopyTask().tokenizer), cfg.dp.tp)))
        return groups[-1], cfg

    yield make
    for group in groups:
        group.shutdown()
