"""algo=ppo end to end: the critic trains beside the policy, dp=cells computes what dp=classic does (actor and
critic), a killed critic cell is dropped, re-split and healed like an actor cell, and a PPO run resumes both.

The cells run has its critic cell 1 killed mid-backward at step 1: steps before the kill match the classic world to
round-off (1e-6 relative), and after the re-split the final weights of both models match it to 1e-4 (the survivor
sums the gradients of the fault step in another order, as in test_faults).
"""

import shutil

import pytest
from harness import max_abs_diff, read_jsonl, run_rlfw

from rlfw.checkpoint.layout import list_steps, verify
from rlfw.checkpoint.state import read_model_weights

pytestmark = pytest.mark.e2e

STEPS = 3
COMMON = ("algo=ppo", f"num_steps={STEPS}", "rollout.num_prompts=4", "ft.verify_weights_every=1", "split=delayed",
          "checkpoint.interval=1")
CLASSIC = (*COMMON, "dp=classic", "dp.size=2")


def checkpoint(run_dir, role):
    _, ckpt = list_steps(run_dir / "checkpoints")[0]
    verify(ckpt)
    return read_model_weights(str(ckpt if role == "actor" else ckpt / "critic"))


def test_ppo_cells_with_a_killed_critic_cell_match_classic(reference_run, tmp_path):
    classic = reference_run(*CLASSIC)
    cells = run_rlfw(tmp_path / "cells", *COMMON, "dp=cells", "dp.num_cells=2", "fault=kill_once",
                     "fault.role=critic", "fault.cell=1", "fault.step=1", "fault.phase=mid_forward_backward",
                     "ft.await_replacement_s=120")
    rows_classic, rows_cells = read_jsonl(classic / "metrics.jsonl"), read_jsonl(cells / "metrics.jsonl")
    assert len(rows_classic) == len(rows_cells) == STEPS
    for a, b in zip(rows_classic, rows_cells):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["critic/loss"] > 0
    a, b = rows_classic[0], rows_cells[0]  # before the kill
    assert a["critic/loss"] == pytest.approx(b["critic/loss"], rel=1e-6)
    assert a["critic/explained_variance"] == pytest.approx(b["critic/explained_variance"], rel=1e-6, abs=1e-9)
    for r in range(2):
        assert a[f"critic_dp/{r}/num_samples"] == b[f"critic_cell/{r}/num_samples"] > 0
    assert rows_cells[1]["critic_cell/0/num_samples"] == 32 and "critic_cell/1/num_samples" not in rows_cells[1]
    for role in ("actor", "critic"):
        assert max_abs_diff(checkpoint(classic, role), checkpoint(cells, role)) < 1e-4, role

    events = read_jsonl(cells / "events.jsonl")
    critic_events = [e["kind"] for e in events if e.get("role") == "critic"]
    assert "cell_failed" in critic_events and "heal" in critic_events, critic_events
    assert not [e for e in events if e["kind"] == "cell_failed" and e.get("role") != "critic"]  # the actor lives
    ledger = read_jsonl(cells / "ledger.jsonl")
    assert [e["sample_ids"] for e in ledger] == [list(range(s * 32, (s + 1) * 32)) for s in range(STEPS)]
    for entry in ledger:
        for digests in (entry["critic_weight_digests"], entry["weight_digests"]):
            assert len(set(digests.values())) == 1
    assert len(ledger[-1]["critic_weight_digests"]) == 2  # the healed critic cell equals its peer


def test_ppo_resume_restores_policy_and_critic(reference_run, tmp_path):
    """The critic is committed inside the policy's checkpoint: a run that starts from the uninterrupted run's
    checkpoint after step 1 (a copy, as if that run had stopped there) equals it, for both models, bitwise."""
    straight = reference_run(*CLASSIC)
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step_1", resumed / "checkpoints" / "step_1")
    assert (resumed / "checkpoints" / "step_1" / "critic").is_dir()
    run_rlfw(resumed, *CLASSIC, "resume=auto")
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl")] == [1, 2]
    for role in ("actor", "critic"):
        assert max_abs_diff(checkpoint(resumed, role), checkpoint(straight, role)) == 0.0, role
