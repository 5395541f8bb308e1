"""algo=ppo end to end: the critic trains beside the policy, dp=cells computes what dp=classic does (actor and
critic), and a killed critic cell is dropped, re-split and healed like an actor cell."""

import pytest
from harness import final_model, max_abs_diff, read_jsonl, run_rlfw

from rlfw.checkpoint.layout import list_steps, verify
from rlfw.checkpoint.state import read_model_weights

pytestmark = pytest.mark.e2e

COMMON = ["algo=ppo", "num_steps=2", "rollout.num_prompts=4", "ft.verify_weights_every=1", "split=delayed"]


def final_critic(run_dir):
    _, ckpt = list_steps(run_dir / "checkpoints")[0]
    verify(ckpt)
    return read_model_weights(str(ckpt / "critic"))


def test_ppo_cells_match_classic(run):
    classic = run("classic", *COMMON, "dp=classic", "dp.size=2")
    cells = run("cells", *COMMON, "dp=cells", "dp.num_cells=2")
    rows_classic, rows_cells = read_jsonl(classic / "metrics.jsonl"), read_jsonl(cells / "metrics.jsonl")
    assert len(rows_classic) == len(rows_cells) == 2
    for a, b in zip(rows_classic, rows_cells):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["critic/loss"] == pytest.approx(b["critic/loss"], rel=1e-6) and a["critic/loss"] > 0
        assert a["critic/explained_variance"] == pytest.approx(b["critic/explained_variance"], rel=1e-6, abs=1e-9)
        for r in range(2):
            assert a[f"critic_dp/{r}/num_samples"] == b[f"critic_cell/{r}/num_samples"] > 0
    assert max_abs_diff(final_model(classic), final_model(cells)) < 1e-6
    assert max_abs_diff(final_critic(classic), final_critic(cells)) < 1e-6
    for entry in read_jsonl(cells / "ledger.jsonl"):
        assert len(entry["critic_weight_digests"]) == 2 and len(set(entry["critic_weight_digests"].values())) == 1


def test_killed_critic_cell_heals(run):
    run_dir = run("kill", *COMMON, "num_steps=3", "dp=cells", "dp.num_cells=2", "fault=kill_once", "fault.role=critic",
                  "fault.cell=1", "fault.step=1", "fault.phase=mid_forward_backward", "ft.await_replacement_s=120")
    events = read_jsonl(run_dir / "events.jsonl")
    critic_events = [e["kind"] for e in events if e.get("role") == "critic"]
    assert "cell_failed" in critic_events and "heal" in critic_events, critic_events
    assert not [e for e in events if e["kind"] == "cell_failed" and e.get("role") != "critic"]  # the actor lives
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    per_step = 4 * 8
    assert [e["sample_ids"] for e in ledger] == [list(range(s * per_step, (s + 1) * per_step)) for s in range(3)]
    last = ledger[-1]["critic_weight_digests"]
    assert len(last) == 2 and len(set(last.values())) == 1  # the healed critic cell equals its peer


def test_ppo_resume_restores_policy_and_critic(run):
    """The critic is committed inside the policy's checkpoint: a PPO run stopped after 1 step and resumed equals
    the run that never stopped, for both models."""
    straight = run("straight", *COMMON, "checkpoint.interval=1")
    resumed = run("resumed", *COMMON, "num_steps=1", "checkpoint.interval=1")
    assert (resumed / "checkpoints" / "step_1" / "critic").is_dir()
    run_rlfw(resumed, *COMMON, "checkpoint.interval=1", "resume=auto")
    assert max_abs_diff(final_model(resumed), final_model(straight)) == 0.0
    assert max_abs_diff(final_critic(resumed), final_critic(straight)) == 0.0
