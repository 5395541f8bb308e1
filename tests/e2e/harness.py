"""Run the real stack (Ray, Megatron workers, torchft, the local engine) in-process, with Hydra's compose API."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from rlfw.config import register_configs

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()

# Small and fast: 4 prompts x 8 samples per step, micro-batches of 128 tokens (several per replica).
FAST = ["rollout.num_prompts=8", "logger=jsonl", "algo.max_tokens_per_microbatch=128"]


def compose_cfg(run_dir: Path, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*FAST, f"run_dir={run_dir}", *overrides])
    return cfg


def run_rlfw(run_dir: Path, *overrides) -> Path:
    from rlfw.train import train

    train(compose_cfg(run_dir, *overrides), run_dir)
    return run_dir


def read_jsonl(path: Path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def final_model(run_dir: Path) -> dict:
    """The model weights of the run's newest checkpoint (which must verify)."""
    from rlfw.checkpoint.layout import list_steps, verify
    from rlfw.checkpoint.state import read_model_weights

    _, ckpt = list_steps(run_dir / "checkpoints")[0]
    verify(ckpt)
    return read_model_weights(str(ckpt))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if not k.endswith("_extra_state"))
