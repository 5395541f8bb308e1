"""GoodputMeter: the ft/* figures of every committed step, counted over the whole run, restarts included."""

import json

import pytest

from rlfw.ft.goodput import GoodputMeter, run_started
from rlfw.run_files import RUN_STARTED


def test_goodput_and_ettr_count_the_kept_steps_over_the_wall_clock():
    meter = GoodputMeter(started=100.0)
    first = meter.committed(0, step_s=2.0, samples=8, now=102.0)
    assert first["ft/goodput"] == 4.0 and first["ft/ettr"] == 1.0 and "ft/mttr_last_s" not in first
    second = meter.committed(1, step_s=2.0, samples=8, now=108.0)  # 2 s of the last 6 were spent on no step
    assert second["ft/goodput"] == 16 / 8 and second["ft/ettr"] == 4 / 8


def test_mttr_runs_from_the_first_failure_to_the_next_commit_less_a_typical_step():
    meter = GoodputMeter(started=0.0)
    meter.committed(0, 2.0, 8, now=2.0)
    meter.failure(detected_at=3.0)
    meter.failure(detected_at=3.5)  # a second cell in the same recovery: the clock already runs
    after = meter.committed(1, 3.0, 8, now=6.0)
    assert after["ft/mttr_last_s"] == pytest.approx(6.0 - 3.0 - 2.5)  # the median of the kept steps: 2.5 s
    assert meter.committed(2, 2.0, 8, now=8.0)["ft/mttr_last_s"] == after["ft/mttr_last_s"]  # the last one's, held


def test_a_rewind_drops_the_steps_thrown_away():
    meter = GoodputMeter(started=0.0)
    for step in range(3):
        meter.committed(step, 1.0, 4, now=step + 1.0)
    meter.rewind(1)
    figures = meter.committed(1, 1.0, 4, now=10.0)
    assert figures["ft/goodput"] == 8 / 10 and figures["ft/ettr"] == 2 / 10


def test_a_resumed_run_counts_the_earlier_jobs_and_dates_the_restart_by_their_last_step(tmp_path):
    assert run_started(tmp_path, resuming=False, now=50.0) == 50.0
    assert run_started(tmp_path, resuming=True, now=90.0) == 50.0  # the run's first start, not this job's
    assert json.loads((tmp_path / RUN_STARTED).read_text()) == {"started": 50.0}
    kept = [{"step": 0, "time/step": 2.0, "train/num_samples": 8, "time/wall": 60.0}]
    thrown = [{"step": 1, "time/step": 2.0, "train/num_samples": 8, "time/wall": 62.0}]  # rewound by the resume
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (tmp_path / "metrics.jsonl.rewound").write_text("".join(json.dumps(r) + "\n" for r in thrown))
    meter = GoodputMeter.for_run(tmp_path, started=50.0, resuming=True)
    figures = meter.committed(1, 2.0, 8, now=70.0)
    assert figures["ft/goodput"] == 16 / 20 and figures["ft/ettr"] == 4 / 20
    assert figures["ft/mttr_last_s"] == pytest.approx(70.0 - 62.0 - 2.0)
    assert "ft/mttr_last_s" not in GoodputMeter.for_run(tmp_path, 50.0, resuming=False).committed(0, 1.0, 1, 51.0)


def test_a_torn_start_file_is_an_error_naming_it(tmp_path):
    (tmp_path / RUN_STARTED).write_text('{"star')  # what a full disk leaves of a plain write
    with pytest.raises(ValueError, match=RUN_STARTED):
        run_started(tmp_path, resuming=True, now=90.0)
    (tmp_path / RUN_STARTED).unlink()
    run_started(tmp_path, resuming=False, now=50.0)
    assert not list(tmp_path.glob("*.partial"))  # written aside, then renamed into place
