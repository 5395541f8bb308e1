"""A run that cannot train stops with an error that says why, through ``python -m rlfw.train`` as a user runs it."""

import subprocess
import sys
from pathlib import Path

import pytest
from harness import FAST

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_prompts_longer_than_the_context_stop_the_run_naming_the_key(tmp_path):
    # The copy task's prompt is BOS + length symbols + "=": with length 100 every prompt fills the 64-token context.
    result = subprocess.run(
        [sys.executable, "-m", "rlfw.train", *FAST, f"run_dir={tmp_path}", "task.length=100", "num_steps=3",
         "dp=classic", "dp.size=1"],  # one rank: the check is the rollout's, the trainer need only start
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "cannot train: step 0: every prompt that was sampled is dropped: 8 prompts" in output, output[-3000:]
    assert "model.max_seq_len=64" in output and "Traceback" not in output
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # nothing was logged as if it had trained
