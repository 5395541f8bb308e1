"""The checkpoint-restart side of bench/bench_faults.py, short: a SIGKILL ends a classic job, the supervisor restarts
it with resume=auto, and the bench's figures agree with records it did not derive them from (the supervisor's own job
log, the fault marker, the ledger's rewound entries). One restart, not several: each job costs a cluster's start-up,
and the figures already span two jobs (the run's ft/* sum over both); several kills in one run are the soak test's."""

import json
import sys
from pathlib import Path

import pytest
from harness import FAST, read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_faults import fault_overrides  # noqa: E402
from restart_loop import EXIT_RESTARTABLE, account, fault_markers, supervise  # noqa: E402

pytestmark = pytest.mark.e2e
STEPS, INTERVAL, KILLS = 5, 2, [3]


def test_a_restart_is_accounted_for(tmp_path):
    run_dir = tmp_path / "restart"
    overrides = [*FAST, "dp=classic", "dp.size=2", f"num_steps={STEPS}", f"checkpoint.interval={INTERVAL}",
                 "checkpoint.save_final=false", *fault_overrides(KILLS)]
    jobs = supervise(run_dir, overrides, max_restarts=2, job_timeout_s=600)
    row = account("checkpoint_restart", run_dir, jobs)

    # The supervisor's own log: a job ended by a lost worker, the next one finished (no restart beyond the need).
    log = json.loads((run_dir / "supervisor.json").read_text())
    assert [j["returncode"] for j in log] == [EXIT_RESTARTABLE, 0]
    markers = fault_markers(run_dir)
    assert [(m["step"], m["signal"]) for m in markers] == [(3, "kill")]
    assert row["failures"] == 1 and row["restarts"] == 1

    # The kill threw away the steps since the last checkpoint: the ledger's rewound entries are exactly those.
    rewound = read_jsonl(run_dir / "ledger.jsonl.rewound")
    expected = [s for m in markers for s in range(m["step"] - m["step"] % INTERVAL, m["step"])]
    assert sorted(r["step"] for r in rewound) == expected == [2]
    assert row["steps_recomputed"] == len(rewound)
    final = {r["step"]: r for r in read_jsonl(run_dir / "ledger.jsonl")}
    in_flight = sum(len(final[m["step"]]["sample_ids"]) for m in markers)  # generated, never committed
    assert row["samples_lost"] == sum(len(r["sample_ids"]) for r in rewound) + in_flight

    # In the end every step is kept once and every sample trained once.
    assert sorted(final) == list(range(STEPS))
    ids = [i for r in final.values() for i in r["sample_ids"]]
    assert len(ids) == len(set(ids)) and row["samples"] == len(ids)
    assert len(row["mttr_s"]) == 1

    # The run's own ft/* figures count every job: the final goodput is all kept samples over the wall time since
    # the first job started (the supervisor's clock brackets it), and the restart's recovery has an MTTR.
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    started = json.loads((run_dir / "run_started.json").read_text())["started"]
    assert log[0]["started"] <= started <= log[0]["ended"]
    last = metrics[-1]
    assert last["ft/goodput"] * (last["time/wall"] - started) == pytest.approx(len(ids))
    assert last["ft/ettr"] * (last["time/wall"] - started) == pytest.approx(sum(r["time/step"] for r in metrics))
    first_after_restart = [next(r for r in metrics if r["step"] == m["step"] - m["step"] % INTERVAL) for m in markers]
    assert all(r["ft/mttr_last_s"] > 0 for r in first_after_restart)
    assert "ft/mttr_last_s" not in metrics[0]
