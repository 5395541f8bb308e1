"""Cells sharing one GPU (``cluster.gpus_per_worker=0.5``): the config rules, and on a CUDA machine the real path.

Two one-rank cells on one device: each cell is its own NCCL world of one rank; across cells torchft's group is Gloo
(NCCL cannot join two processes on one GPU). A real SIGKILL of cell 1 mid forward/backward: the survivor redoes the
step, a replacement heals from the survivor's memory over Gloo, every sample is trained exactly once, both cells'
weights are bitwise equal after every step (heals included), and the final weights match a failure-free run up to
the rounding of a different split (bf16 activations).
"""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from rlfw.config import ConfigError, register_configs, validate

register_configs()


def cfg(*overrides):
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return compose(config_name="config", overrides=["dp=cells", *overrides])


def test_two_cells_may_share_one_gpu():
    # the engine beside them on the same GPU: colocated (separate placement would give it a GPU of its own)
    validate(cfg("cluster.gpus_per_worker=0.5", "dp.num_cells=2", "cluster.placement=colocated"), num_devices=1)
    with pytest.raises(ConfigError, match=r"need 2 GPUs but 1 are visible; use cluster.placement=colocated"):
        validate(cfg("cluster.gpus_per_worker=0.5", "dp.num_cells=2"), num_devices=1)
    with pytest.raises(ConfigError, match=r"dp.num_cells=3 .* needs 1.5 GPUs but 1 are visible"):
        validate(cfg("cluster.gpus_per_worker=0.5", "dp.num_cells=3"), num_devices=1)
    with pytest.raises(ConfigError, match=r"needs 2 GPUs but 1 are visible"):
        validate(cfg("dp.num_cells=2"), num_devices=1)


@pytest.mark.parametrize("overrides", [
    ("dp=classic", "dp.size=2"),  # two ranks of one NCCL world
    ("dp.tp=2",),  # a cell of two ranks
])
def test_only_one_rank_cells_share_a_gpu(overrides):
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_worker=0.5 shares a GPU between ranks"):
        validate(cfg("cluster.gpus_per_worker=0.5", *overrides), num_devices=4)


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_gpu_share_out_of_range(share):
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_worker=.* must be in \(0, 1\]"):
        validate(cfg(f"cluster.gpus_per_worker={share}"), num_devices=1)


STEPS = 4
SHARED = ["dp=cells", "dp.num_cells=2", "cluster.device=cuda", "cluster.gpus_per_worker=0.5",
          "cluster.placement=colocated", f"num_steps={STEPS}",
          "ft.await_replacement_s=60", "ft.verify_weights_every=1", "split=delayed", "rollout.num_prompts=4",
          "checkpoint.interval=1"]


def l2(a: dict, b: dict) -> float:
    """The L2 norm of the difference of two weight sets (every tensor, as one vector)."""
    return sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a if not k.endswith("_extra_state")) ** 0.5


@pytest.mark.e2e
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cells_on_one_gpu_kill_and_heal(tmp_path):
    """Against a failure-free run on the same device. Before the kill both runs do the same arithmetic: the weights
    after step 0 are bitwise equal. After it the survivor sums the fault step's gradient in another order, in bf16:
    the gap to the failure-free weights must stay under a tenth of what one optimizer step moves them (measured on
    the reference itself, step 3 -> 4). The same bound rejects the kill run's own weights one step earlier, so it
    separates a correct re-split from a lost update."""
    from harness import checkpoint_model, max_abs_diff, read_jsonl, run_rlfw

    reference = run_rlfw(tmp_path / "reference", *SHARED)
    run_dir = run_rlfw(tmp_path / "kill", *SHARED, "fault=kill_once", "fault.cell=1", "fault.step=1",
                       "fault.phase=mid_forward_backward")
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    per_step = 4 * 8
    assert [e["sample_ids"] for e in ledger] == [list(range(s * per_step, (s + 1) * per_step)) for s in range(STEPS)]
    for entry in ledger:  # both cells bitwise equal after every step, the heal included
        assert len(set(entry["weight_digests"].values())) == 1, entry
    assert max(len(e["weight_digests"]) for e in ledger) == 2  # the replacement is back
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert "cell_failed" in kinds and "heal" in kinds, kinds
    fault_step = read_jsonl(run_dir / "metrics.jsonl")[1]
    assert fault_step["cell/0/num_samples"] == per_step  # the survivor redid the whole step

    assert max_abs_diff(checkpoint_model(run_dir, 1), checkpoint_model(reference, 1)) == 0.0
    final, expected = checkpoint_model(run_dir, STEPS), checkpoint_model(reference, STEPS)
    one_step = l2(checkpoint_model(reference, STEPS - 1), expected)
    gap = l2(final, expected)
    print(f"|kill run - reference| = {gap:.3g}, one optimizer step = {one_step:.3g}")
    assert gap < 0.1 * one_step
    # the negative control: the kill run one optimizer step short (its own step-3 weights) is rejected by the bound
    assert l2(checkpoint_model(run_dir, STEPS - 1), expected) >= 0.1 * one_step


@pytest.mark.e2e
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_classic_on_one_gpu_trains_like_one_cell(tmp_path):
    """dp=classic on CUDA is an NCCL world, whose groups have no CPU backend: its per-step agreement check once
    all-reduced a CPU tensor there and the first step died. One classic replica and one cell on the same device do
    the same arithmetic (a sum over one replica is the identity, whichever transport carries it): the same samples
    trained, and the weights bitwise equal after every step."""
    from harness import checkpoint_model, max_abs_diff, read_jsonl, run_rlfw

    common = ["cluster.device=cuda", "cluster.placement=colocated", f"num_steps={STEPS}", "rollout.num_prompts=4",
              "checkpoint.interval=1"]
    classic = run_rlfw(tmp_path / "classic", "dp=classic", "dp.size=1", *common)
    cell = run_rlfw(tmp_path / "cell", "dp=cells", "dp.num_cells=1", *common)
    assert [e["sample_ids"] for e in read_jsonl(classic / "ledger.jsonl")] == \
        [e["sample_ids"] for e in read_jsonl(cell / "ledger.jsonl")]
    for step in range(1, STEPS + 1):
        assert max_abs_diff(checkpoint_model(classic, step), checkpoint_model(cell, step)) == 0.0, step
