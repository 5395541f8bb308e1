"""The report of a real run: two cells, one SIGKILLed at step 1 and replaced, then ``python -m rlfw.report``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the e2e harness runs the real trainer
from harness import read_jsonl, run_rlfw

from rlfw.report.figures import DPI, RUN_FIGSIZE

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_report_of_a_real_run_with_a_failure(tmp_path):
    run_dir = run_rlfw(tmp_path / "run", "dp=cells", "num_steps=3", "rollout.num_prompts=4", "fault=kill_once",
                       "fault.cell=1", "fault.step=1", "fault.phase=before_forward", "ft.await_replacement_s=60")
    result = subprocess.run([sys.executable, "-m", "rlfw.report", str(run_dir)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr

    with Image.open(run_dir / "report" / "run.png") as image:
        assert image.format == "PNG" and image.size == (RUN_FIGSIZE[0] * DPI, RUN_FIGSIZE[1] * DPI)
    panels = {p["title"]: p for p in json.loads((run_dir / "report" / "run.json").read_text())["panels"]}
    assert panels["Reward (mean ± std)"]["series"] == ["reward/mean", "± reward/std"]
    assert panels["Samples per replica"]["series"] == ["cell/0", "cell/1"]
    assert panels["Alive cells and quorum id"]["series"] == ["cells/alive", "ft/quorum_id"]
    kinds = list(dict.fromkeys(event["kind"] for event in read_jsonl(run_dir / "events.jsonl")))
    assert panels["Events"]["series"] == kinds
    assert {"cell_failed", "quorum_change", "heal"} <= set(kinds)
