"""Hydra multirun: `python -m rlfw.train -m ...` runs each job in its own Ray session and run directory."""

import subprocess
import sys
from pathlib import Path

import pytest
from harness import read_jsonl

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_multirun_sweep_over_dp_modes(tmp_path):
    cmd = [sys.executable, "-m", "rlfw.train", "-m", "dp=classic,cells", "num_steps=2", "logger=jsonl",
           "rollout.num_prompts=4", f"hydra.sweep.dir={tmp_path}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert [p.name.split("_", 1)[1].split(",")[0] for p in jobs] == ["dp=classic", "dp=cells"]
    classic, cells = (read_jsonl(p / "metrics.jsonl") for p in jobs)
    assert [r["loss"] for r in classic] == [r["loss"] for r in cells]
    assert "cell/1/num_samples" in cells[0] and "dp/1/num_samples" in classic[0]
