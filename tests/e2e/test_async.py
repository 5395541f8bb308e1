"""loop=async through the whole stack: with max_staleness=0 it is the synchronous loop, bitwise; with 1 the next
step's rollout is generated while a step trains, and the fault-tolerance promises hold while it does: a cell
SIGKILLed mid-step, the weight writer killed while it exports, and the rollout engine SIGKILLed at an arbitrary
moment (in a generate call or a weight push) lose no sample, and no token lags more than one version behind the
weights that train on it.
"""

import os
import threading
import time

import psutil
import pytest
from harness import STEPS, check_every_sample_once, final_model, max_abs_diff, read_jsonl, run_rlfw
from process_marks import marked_processes
from test_cells import CELLS2
from test_faults import kills

pytestmark = pytest.mark.e2e
SESSION = "RLFW_TEST_SESSION"  # tests/conftest.py: every process this session started carries it


def test_async_with_no_staleness_is_the_synchronous_loop(reference_run, run):
    """k=0 asks for no rollout ahead: the same rollouts, losses and weights, bit for bit. (loop=async turns the
    behaviour weight, algo.tis_cap, on; it is set as in the synchronous run, whose objective is compared.)"""
    sync = reference_run(*CELLS2)
    async0 = run("async0", *CELLS2, "loop=async", "loop.max_staleness=0", "algo.tis_cap=0")
    rows_sync, rows_async = read_jsonl(sync / "metrics.jsonl"), read_jsonl(async0 / "metrics.jsonl")
    assert len(rows_sync) == len(rows_async) == STEPS
    for a, b in zip(rows_sync, rows_async):
        assert (a["reward/mean"], a["loss"], a["train/grad_norm"]) == (b["reward/mean"], b["loss"], b["train/grad_norm"])
        assert b["loop/staleness_max"] == 0
    ledger_sync, ledger_async = check_every_sample_once(sync), check_every_sample_once(async0)
    assert [e["weight_digests"] for e in ledger_sync] == [e["weight_digests"] for e in ledger_async]
    assert max_abs_diff(final_model(sync), final_model(async0)) == 0.0


def kill_engine_at(run_dir, step: int, killed: list) -> threading.Thread:
    """SIGKILL this session's rollout engine process once the run has logged ``step`` (whatever it is doing then)."""

    def watch():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            path = run_dir / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) > step:
                for proc in marked_processes(SESSION, os.environ[SESSION]):
                    try:
                        if any("ray::LocalEngine" in part for part in proc.cmdline()):
                            proc.kill()
                            killed.append(proc.pid)
                    except psutil.NoSuchProcess:
                        pass
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_async_survives_a_cell_the_writer_and_the_engine_dying_and_resumes_from_the_checkpoint(tmp_path):
    """One run through two jobs. The first (7 steps): a cell SIGKILLed mid-step, the writer killed while it exports
    and the engine killed after step 3. The second resumes from the first's final checkpoint: a checkpoint does not
    hold the rollouts asked for ahead, so the resumed job generates them again from the checkpoint's weights, and its
    first step trains at staleness 0. Every step of the run is trained once, on its own samples. The samples are
    multi-turn episodes with a tool (task=calc): one sample per episode, the staleness bound on its oldest policy
    token."""
    run_dir = tmp_path / "async"
    common = ["dp=cells", "dp.num_cells=2", "loop=async", "loop.max_staleness=1", "checkpoint.interval=2",
              "ft.verify_weights_every=1", "task=calc"]
    first_steps, steps = 7, 9
    killed: list = []
    watcher = kill_engine_at(run_dir, 3, killed)
    run_rlfw(run_dir, *common, f"num_steps={first_steps}", "ft.await_replacement_s=60", "fault=kill_once",
             *kills((1, 2, "mid_forward_backward", 0), (0, 5, "weight_sync", 0)))
    watcher.join(5)
    assert killed, "the engine was never found to kill"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[-1]["rollout/engine_restarts"] >= 1 and rows[-1]["rollout/engines_alive"] == 1
    assert sum(e["kind"] == "cell_failed" for e in read_jsonl(run_dir / "events.jsonl")) == 2

    run_rlfw(run_dir, *common, f"num_steps={steps}", "resume=auto")
    check_every_sample_once(run_dir, steps=steps)  # each step's own samples, each trained once, cells bitwise equal
    rows = read_jsonl(run_dir / "metrics.jsonl")
    staleness = [r["loop/staleness_max"] for r in rows]
    # Each job's first step trains on a rollout of the weights it started from (the resumed one's: the checkpoint's,
    # generated again); later ones at most one version behind. (Whether a later rollout ran ahead depends on how
    # generation and training interleave: a push that lands before a generation starts makes its step fresh.)
    assert staleness[0] == staleness[first_steps] == 0 and all(s <= 1 for s in staleness), staleness
    assert max(staleness) == 1  # generation ran ahead of training
    assert all(1 <= r["env/turns_mean"] <= r["env/turns_max"] <= 3 for r in rows)
    # The trainer's tokens are the policy's only: an episode's observations past its prompt are not trained.
    for r in rows:
        response_tokens = round(r["rollout/response_len"] * r["rollout/num_samples"])
        assert (r["train/num_tokens"] < response_tokens) == (r["env/turns_max"] > 1), r["step"]
    assert any(r["env/turns_max"] > 1 for r in rows)
