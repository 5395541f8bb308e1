"""The foundation end to end: the default job (dp=classic) on CPU, its files, and its failure modes."""

from pathlib import Path

import pytest

from rlfw.config import ConfigError
from rlfw.logging import read_wandb_offline_history

from harness import read_jsonl, run_rlfw

pytestmark = pytest.mark.e2e


def test_default_job_writes_metrics_and_wandb_files(tmp_path):
    run_dir = run_rlfw(tmp_path / "run", "num_steps=3", "logger=default")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for key in ("reward/mean", "loss", "train/num_samples", "train/num_tokens", "dp/0/num_samples",
                    "dp/1/num_samples"):
            assert key in row, key
        assert row["train/num_samples"] == 64 == row["dp/0/num_samples"] + row["dp/1/num_samples"]
        # The engine's log-probs and the trainer's recomputation agree: the weight sync is exact.
        assert row["rollout/logprob_abs_diff"] < 1e-4
    history = read_wandb_offline_history(run_dir)
    assert [h["reward/mean"] for h in history if "reward/mean" in h] == [r["reward/mean"] for r in rows]
    assert any("dp/1/num_tokens" in h for h in history)
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [sorted(e["sample_ids"]) for e in ledger] == [list(range(s * 64, (s + 1) * 64)) for s in range(3)]
    assert (run_dir / "checkpoints" / "step_3" / "COMPLETE").exists()


def test_bad_task_target_fails_before_ray(tmp_path):
    import ray

    with pytest.raises(Exception, match="nonexistent"):
        run_rlfw(tmp_path / "run", "task._target_=rlfw.rollout.tasks.nonexistent.Task")
    assert not ray.is_initialized()


def test_bad_value_fails_before_ray(tmp_path):
    import ray

    with pytest.raises(ConfigError, match="rollout.top_p"):
        run_rlfw(tmp_path / "run", "rollout.top_p=0")
    assert not ray.is_initialized()


def test_actor_crash_surfaces_its_traceback(tmp_path, monkeypatch):
    # Ray workers inherit the driver's environment: they can import the test's task.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    with pytest.raises(Exception, match="reward function exploded"):
        run_rlfw(tmp_path / "run", "num_steps=2", "task._target_=crashing_task.CrashingTask")


def test_prompts_longer_than_the_context_are_dropped_and_counted(tmp_path):
    run_dir = run_rlfw(tmp_path / "run", "num_steps=2", "model.max_seq_len=5")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all(r["rollout/dropped_prompts_too_long"] == 8 and r["rollout/num_samples"] == 0 for r in rows)
    assert [e["kind"] for e in read_jsonl(run_dir / "events.jsonl")] == ["empty_batch", "empty_batch"]
