"""What the engine tests (and the rollout bench) share: the config, a tiny policy, and a real process kill."""

import os
import signal
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

from rlfw.config import register_configs
from rlfw.model.hf_convert import hf_config
from rlfw.model.shape import ModelShape
from rlfw.rollout.manager import padded_vocab_size
from rlfw.rollout.tasks import CopyTask
from rlfw.train_group.worker import model_shape

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()


def compose_cfg(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"run_dir={run_dir}", "rollout.cpus_per_engine=0.1", *overrides])
    return cfg


def shape_of(cfg) -> ModelShape:
    task = CopyTask(**{k: v for k, v in cfg.task.items() if k != "_target_"})
    return model_shape(cfg, padded_vocab_size(len(task.tokenizer), 1))


def random_hf_state(shape: ModelShape, seed: int = 0, scale: float = 0.5) -> dict:
    """HF weights larger than HF's init, so that the policy's distributions are far from uniform."""
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(shape))
    return {k: torch.randn(v.shape, generator=generator) * scale for k, v in model.state_dict().items()}


def sigkill(pid: int) -> None:
    """SIGKILL a process and wait until it is gone (it is a child of Ray's raylet, which reaps it)."""
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
