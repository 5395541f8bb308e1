"""loop=async through the whole stack: with max_staleness=0 it is the synchronous loop, bitwise; with 1 the next
step's rollout is generated while a step trains, and the fault-tolerance promises hold while it does: a cell
SIGKILLed mid-step, the weight writer killed while it exports, and the rollout engine SIGKILLed at an arbitrary
moment (in a generate call or a weight push) lose no sample, and no token lags more than one version behind the
weights that train on it.
"""

import threading
import time

import psutil
import pytest
from harness import REFERENCE, STEPS, check_every_sample_once, final_model, max_abs_diff, read_jsonl, run_rlfw
from test_cells import CELLS2
from test_faults import kills

pytestmark = pytest.mark.e2e


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
    """SIGKILL the rollout engine's process once the run has logged ``step`` (whatever it is doing then)."""

    def watch():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            path = run_dir / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) > step:
                for proc in psutil.process_iter(["pid", "cmdline"]):
                    if any("ray::LocalEngine" in part for part in proc.info["cmdline"] or []):
                        proc.kill()
                        killed.append(proc.info["pid"])
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_async_survives_a_cell_the_writer_and_the_engine_dying(tmp_path):
    run_dir = tmp_path / "async_faults"
    killed: list = []
    watcher = kill_engine_at(run_dir, 3, killed)
    run_rlfw(
        run_dir, "dp=cells", "dp.num_cells=2", *REFERENCE, "loop=async", "loop.max_staleness=1",
        "ft.await_replacement_s=60", "fault=kill_once",
        *kills((1, 2, "mid_forward_backward", 0), (0, 5, "weight_sync", 0)),
        "task.length=8",  # longer responses: weight pushes land inside a generation
    )
    watcher.join(5)
    assert killed, "the engine was never found to kill"
    check_every_sample_once(run_dir)  # each step's own samples, each trained once, cells bitwise equal
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all(r["loop/staleness_max"] <= 1 for r in rows)
    assert max(r["loop/staleness_max"] for r in rows) == 1  # generation did run ahead of training
    assert rows[-1]["rollout/engine_restarts"] >= 1 and rows[-1]["rollout/engines_alive"] == 1
    events = read_jsonl(run_dir / "events.jsonl")
    assert sum(e["kind"] == "cell_failed" for e in events) == 2


def test_async_resume_generates_the_later_rollouts_again_from_the_checkpoint(run):
    """A checkpoint does not hold the rollouts asked for ahead: a resumed async run generates them again from the
    checkpoint's weights, so its first step trains at staleness 0 and the next ones at most 1, and every step of the run
    is trained once, on its own samples. The samples are multi-turn episodes with a tool (task=calc): one sample per
    episode, the staleness bound on its oldest policy token."""
    common = ["dp=cells", "loop=async", "loop.max_staleness=1", "checkpoint.interval=2", "ft.verify_weights_every=1",
              "task=calc"]
    run_dir = run("first", *common, "num_steps=4")
    run_rlfw(run_dir, *common, "num_steps=7", "resume=auto")
    check_every_sample_once(run_dir, steps=7)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    staleness = [r["loop/staleness_max"] for r in rows]
    # Each job's first step trains on a rollout of the weights it started from (the resumed one's: the checkpoint's,
    # generated again); later ones at most one version behind. (Whether a later rollout ran ahead depends on how
    # generation and training interleave: a push that lands before a generation starts makes its step fresh.)
    assert staleness[0] == staleness[4] == 0 and all(s <= 1 for s in staleness), staleness
    assert max(staleness) == 1  # generation ran ahead of training
    assert all(1 <= r["env/turns_mean"] <= r["env/turns_max"] <= 3 for r in rows)
    # The trainer's tokens are the policy's only: an episode's observations past its prompt are not trained.
    for r in rows:
        response_tokens = round(r["rollout/response_len"] * r["rollout/num_samples"])
        assert (r["train/num_tokens"] < response_tokens) == (r["env/turns_max"] > 1), r["step"]
    assert any(r["env/turns_max"] > 1 for r in rows)
