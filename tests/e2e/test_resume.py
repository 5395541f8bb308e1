"""Resume: a run stopped at step k and resumed equals the run that never stopped, across dp modes.

Rollouts are a function of (seed, step) and the checkpoint holds model, optimizer and cursor, so a resumed run
repeats the uninterrupted one's computation: bitwise, since classic DP=2 and two cells add the same two numbers.
A checkpoint holds one replica's state, which every cell (or classic rank) loads alike, so another cell count
takes the same path. The uninterrupted run is the session's classic DP=2 reference (a checkpoint every 2 steps).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import CLASSIC2_MINIBATCHES, FAST, checkpoint_model, max_abs_diff, read_jsonl, run_rlfw

from rlfw.checkpoint.layout import read_meta, verify
from rlfw.ft.errors import BelowMinCellsError
from rlfw.logging import read_wandb_offline_history

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
# Three optimizer steps per rollout (24 + 24 + 16 samples), as the reference: a job can stop inside an RL step.
EVERY_STEP = ["checkpoint.interval=1", "logger=default", "ft.verify_weights_every=1", "algo.global_batch_size=24",
              "split=balanced"]


def kill_job_during_save(run_dir: Path, steps_done: int, *overrides) -> None:
    """Start ``python -m rlfw.train`` and SIGKILL the whole job (driver, Ray, trainers) while it writes the
    checkpoint after ``steps_done`` steps."""
    cmd = [sys.executable, "-m", "rlfw.train", *FAST, f"run_dir={run_dir}", *overrides]
    # Its own W&B service, as a job a scheduler starts has: inherited, this process' service would keep the killed
    # job's run open, and the resumed runs below (in this process) could not take its id.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    log = run_dir.parent / f"{run_dir.name}_job.log"
    with open(log, "wb") as out:  # the child keeps its own handle
        job = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=out, stderr=subprocess.STDOUT, env=env)
    staging = run_dir / "checkpoints" / f"step_{steps_done}.tmp"
    deadline = time.monotonic() + 600
    while not staging.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    ended_by_itself = job.poll()
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=60)
    assert ended_by_itself is None, f"the job exited ({ended_by_itself}) before its save: {log.read_text()[-3000:]}"
    assert staging.exists() and not (run_dir / "checkpoints" / f"step_{steps_done}" / "COMPLETE").exists(), \
        "the kill did not land inside the save"


def test_resume_across_a_killed_job_a_lost_cell_and_a_corrupt_checkpoint(reference_run, tmp_path, caplog):
    """One run through three jobs: classic, killed during its second save -> two cells with ft.min_cells=2 and no
    replacement, one of which dies after its vote on step 2's first minibatch (the survivor's state is saved in the
    middle of the step, with the step's batch) -> classic again, past a newer checkpoint that is truncated on disk,
    from the cells' one: it trains step 2's last two minibatches only, on the saved batch. The survivor's train call
    waits in a quorum that cannot form for ft.quorum_timeout_s (an hour here, past the test's own timeout): the save
    must not wait behind it."""
    straight = reference_run(*CLASSIC2_MINIBATCHES)
    run_dir = tmp_path / "run"
    kill_job_during_save(run_dir, 2, "dp=classic", "num_steps=4", *EVERY_STEP)
    assert verify(run_dir / "checkpoints" / "step_1")["step"] == 1
    first_id = read_meta(run_dir / "checkpoints" / "step_1")["wandb_run_id"]

    with pytest.raises(BelowMinCellsError, match=r"2 steps and \{'actor': 1\} minibatches of step 2 is saved in"):
        run_rlfw(run_dir, "dp=cells", "num_steps=4", *EVERY_STEP, "resume=auto", "ft.min_cells=2",
                 "ft.replace_failed=false", "ft.quorum_timeout_s=3600", "fault=kill_once", "fault.cell=1", "fault.step=2",
                 "fault.phase=after_vote")
    saved = verify(run_dir / "checkpoints" / "step_2")
    assert saved["layout"] == {"dp_mode": "cells", "replicas": 2, "tp": 1} and saved["wandb_run_id"] == first_id
    assert saved["partial_step"] == {"actor": 1}  # the first of step 2's three minibatches was committed
    assert (run_dir / "checkpoints" / "step_2" / "partial_step.pkl").name in saved["files"]  # hashed like the rest
    failures = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "cell_failed"]
    assert [(e["step"], e["cell"]) for e in failures] == [(2, 1)]  # logged although the step never finished

    newer = run_dir / "checkpoints" / "step_4"  # a newer checkpoint whose largest file was cut short
    shutil.copytree(straight / "checkpoints" / "step_4", newer)
    victim = max((p for p in newer.rglob("*") if p.is_file() and p.suffix != ".json"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    (run_dir / "checkpoints" / "step_5.tmp").mkdir()  # a save that never finished
    run_rlfw(run_dir, "dp=classic", "num_steps=4", *EVERY_STEP, "resume=auto")
    assert "skipping checkpoint" in caplog.text and "step_4" in caplog.text
    # resumed from the two cells' step_2, finished step 2 and redid step 3 (a fresh step_4 replaced the corrupt one):
    # bitwise the uninterrupted run, so step 2's first minibatch trained exactly once
    assert max_abs_diff(checkpoint_model(run_dir, 4), checkpoint_model(straight, 4)) == 0.0

    assert [e["step"] for e in read_jsonl(run_dir / "ledger.jsonl")] == [0, 1, 2, 3]  # every step trained once
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in read_jsonl(straight / "metrics.jsonl")[:4]]
    # one W&B run across the three jobs: every offline run directory carries the first job's id
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(r.name.endswith(first_id) for r in runs)
    assert read_meta(run_dir / "checkpoints" / "step_4")["wandb_run_id"] == first_id
    # the last job redid step 2 on: the second job's records of it (its failure) were moved to .rewound
    events, rewound = read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "events.jsonl.rewound")
    assert [(e["kind"], e["step"]) for e in events if e["kind"] == "resumed"] == [("resumed", 1), ("resumed", 2)]
    assert [(e["cell"], e["incarnation"]) for e in rewound if e["kind"] == "cell_failed"] == [(1, 0)]
    assert read_wandb_offline_history(run_dir)  # the resumed runs' files are readable
