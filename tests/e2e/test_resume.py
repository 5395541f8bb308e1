"""Resume: a run stopped at step k and resumed equals the run that never stopped, across dp modes and cell counts.

Every run here trains 4 steps; the interrupted ones train 2, checkpoint, and a second job resumes them. Rollouts are
a function of (seed, step) and the checkpoint holds model, optimizer and cursor, so the resumed run repeats
the uninterrupted one's computation: bitwise where the arithmetic is the same, to float round-off where another
cell count sums the gradients in another order.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import FAST, final_model, max_abs_diff, read_jsonl, run_rlfw

from rlfw.checkpoint.layout import list_steps, read_meta, verify
from rlfw.ft.errors import BelowMinCellsError
from rlfw.logging import read_wandb_offline_history

pytestmark = pytest.mark.e2e

COMMON = ["checkpoint.interval=2"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run_rlfw(tmp_path_factory.mktemp("straight"), *COMMON, "num_steps=4")


def _interrupted(run_dir, *overrides):
    run_rlfw(run_dir, *COMMON, "num_steps=2", *overrides)  # stops after step 1: checkpoint step_2


def test_classic_resume_on_cells_equals_uninterrupted(straight, tmp_path):
    run_dir = tmp_path / "run"
    _interrupted(run_dir, "logger=default")
    first_id = read_meta(run_dir / "checkpoints" / "step_2")["wandb_run_id"]
    run_rlfw(run_dir, *COMMON, "num_steps=4", "resume=auto", "logger=default", "dp=cells")
    assert max_abs_diff(final_model(run_dir), final_model(straight)) == 0.0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in read_jsonl(straight / "metrics.jsonl")]
    # one W&B run across the restart: both offline run directories carry the first run's id
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(first_id) for r in runs)
    assert read_meta(run_dir / "checkpoints" / "step_4")["wandb_run_id"] == first_id
    assert [e["kind"] for e in read_jsonl(run_dir / "events.jsonl")].count("resumed") == 1
    assert read_wandb_offline_history(run_dir)  # the resumed run's files are readable


def test_resume_from_3_cells_on_2_cells_then_classic(straight, tmp_path):
    run_dir = tmp_path / "run"
    _interrupted(run_dir, "dp=cells", "dp.num_cells=3")
    run_rlfw(run_dir, "checkpoint.interval=1", "num_steps=3", "resume=auto", "dp=cells", "dp.num_cells=2")
    assert read_meta(run_dir / "checkpoints" / "step_3")["layout"] == {"dp_mode": "cells", "replicas": 2, "tp": 1}
    run_rlfw(run_dir, *COMMON, "num_steps=4", "resume=auto", "dp=classic")
    # Steps 0-1 summed three cells' gradients, in another order than the reference's two replicas: last-bit
    # differences, which Adam's normalisation lifts to ~1e-5 over the later steps (as in test_faults).
    assert max_abs_diff(final_model(run_dir), final_model(straight)) < 1e-4
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [e["step"] for e in ledger] == [0, 1, 2, 3]  # every step trained once across the three jobs


def test_corrupt_newest_checkpoint_falls_back_to_older(straight, tmp_path, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(straight / "checkpoints", run_dir / "checkpoints")
    newest = run_dir / "checkpoints" / "step_4"
    victim = max((p for p in newest.rglob("*") if p.is_file() and p.suffix != ".json"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    (run_dir / "checkpoints" / "step_6.tmp").mkdir()  # a save that never finished
    run_rlfw(run_dir, *COMMON, "num_steps=4", "resume=auto")
    assert "skipping checkpoint" in caplog.text and "step_4" in caplog.text
    # resumed from step_2 and redid steps 2 and 3 (a fresh step_4 replaced the corrupt one): the result is the
    # uninterrupted run's
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [2, 3]
    assert [s for s, _ in list_steps(run_dir / "checkpoints")] == [4, 2]
    assert max_abs_diff(final_model(run_dir), final_model(straight)) == 0.0


def test_job_killed_during_save_keeps_previous_checkpoint(tmp_path):
    """SIGKILL the whole job (driver, Ray, trainers) while step_2 is being written; resume=auto goes on from
    step_1 and redoes the lost step."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlfw.train", *FAST, f"run_dir={run_dir}", "checkpoint.interval=1", "num_steps=3"]
    job = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    staging, committed = run_dir / "checkpoints" / "step_2.tmp", run_dir / "checkpoints" / "step_2"
    deadline = time.monotonic() + 600
    while not staging.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert staging.exists() and not (committed / "COMPLETE").exists(), "the kill did not land inside the save"
    assert verify(run_dir / "checkpoints" / "step_1")["step"] == 1
    run_rlfw(run_dir, "checkpoint.interval=1", "num_steps=3", "resume=auto")
    assert [e["step"] for e in read_jsonl(run_dir / "ledger.jsonl")] == [0, 1, 2]
    assert [s for s, _ in list_steps(run_dir / "checkpoints")] == [3, 2, 1]


def test_below_min_cells_saves_the_survivors_state_and_resume_finishes(straight, tmp_path):
    """ft.min_cells=2 and no replacements: the death of a cell at step 2 stops the run with the survivor's state
    saved (steps 0-1), and resume=auto on a classic world finishes the run the uninterrupted way."""
    run_dir = tmp_path / "run"
    with pytest.raises(BelowMinCellsError, match="saved in"):
        run_rlfw(run_dir, "dp=cells", "ft.min_cells=2", "ft.replace_failed=false", "ft.quorum_timeout_s=10",
                 "fault=kill_once", "fault.cell=1", "fault.step=2", "num_steps=4")
    assert verify(run_dir / "checkpoints" / "step_2")["layout"]["dp_mode"] == "cells"
    run_rlfw(run_dir, *COMMON, "num_steps=4", "resume=auto")
    assert [e["step"] for e in read_jsonl(run_dir / "ledger.jsonl")] == [0, 1, 2, 3]
    assert max_abs_diff(final_model(run_dir), final_model(straight)) < 1e-6
