"""Run the real stack (Ray, Megatron workers, torchft, the local engine) in-process, with Hydra's compose API.

Start-up (Ray, then importing torch, Megatron and transformers in every actor) is most of an e2e run's time on a
small CPU machine, so the e2e tests share one Ray instance (``shared_ray`` in tests/conftest.py), compute each
fault-free reference run once (``reference_run``), and fold several faults into one run where each fault's
invariants can still be checked on its own step.
"""

from pathlib import Path

from hydra import compose, initialize_config_dir

from rlfw.config import register_configs
from rlfw.run_files import read_jsonl

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()

# Small and fast: 8 prompts x 8 samples per step, micro-batches of 128 tokens (several per replica).
FAST = ["rollout.num_prompts=8", "logger=jsonl", "algo.max_tokens_per_microbatch=128"]
SAMPLES_PER_STEP = 64

# The runs the fault, cells and resume tests compare: the same data and seed, 10 steps, a checkpoint every 2.
STEPS = 10
REFERENCE = [f"num_steps={STEPS}", "checkpoint.interval=2", "ft.verify_weights_every=1"]
CLASSIC2 = ("dp=classic", "dp.size=2", *REFERENCE)
# Several optimizer steps per rollout (64 samples: 24 + 24 + 16), split by Karmarkar-Karp.
CLASSIC2_MINIBATCHES = (*CLASSIC2, "algo.global_batch_size=24", "split=balanced")


def compose_cfg(run_dir: Path, *overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*FAST, f"run_dir={run_dir}", *overrides])
    return cfg


def run_rlfw(run_dir: Path, *overrides) -> Path:
    from rlfw.train import train

    train(compose_cfg(run_dir, *overrides), run_dir)
    return run_dir


def checkpoint_model(run_dir: Path, steps_done: int | None = None) -> dict:
    """The model weights of the run's checkpoint after ``steps_done`` steps (default: the newest); it must verify."""
    from rlfw.checkpoint.layout import list_steps, verify
    from rlfw.checkpoint.state import read_model_weights

    steps = dict(list_steps(run_dir / "checkpoints"))
    ckpt = steps[max(steps) if steps_done is None else steps_done]
    verify(ckpt)
    return read_model_weights(str(ckpt))


def final_model(run_dir: Path) -> dict:
    """The model weights of the run's newest checkpoint (which must verify)."""
    return checkpoint_model(run_dir)


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if not k.endswith("_extra_state"))


def check_every_sample_once(run_dir: Path, steps: int = STEPS, per_step: int = SAMPLES_PER_STEP) -> list:
    """The ledger: each step trained its own sample ids exactly once, and every replica held the same weights
    after every committed step. Returns the ledger."""
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [e["step"] for e in ledger] == list(range(steps))
    assert [e["sample_ids"] for e in ledger] == [list(range(s * per_step, (s + 1) * per_step)) for s in range(steps)]
    for entry in ledger:
        assert len(set(entry["weight_digests"].values())) == 1, entry["step"]
    return ledger
