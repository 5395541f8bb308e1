"""A sweep job that raises fails that job only, with its record; the sweep's summary reads each job's outcome file,
and a torn one (left by an earlier sweep killed mid-write into the same directory) is skipped with a warning, not
the end of the summary. (tests/e2e/test_sweep.py runs a whole sweep with a failing job.)"""

import json
import logging

import pytest

from rlfw.run_files import FAILED, OUTCOME, read_failure
from rlfw.sweep import SweepCallback, run_sweep_job


def test_a_job_that_raises_is_recorded_and_the_next_attempt_clears_the_record(tmp_path):
    def exploding():
        raise ValueError("reward function exploded")

    assert run_sweep_job(exploding, tmp_path) is None  # contained: the basic launcher goes on with the next job
    failure = read_failure(tmp_path)
    assert (failure["type"], failure["message"]) == ("ValueError", "reward function exploded")
    assert "in exploding" in failure["traceback"] and failure["wall_s"] >= 0
    assert run_sweep_job(lambda: 1.5, tmp_path) == 1.5
    assert not (tmp_path / FAILED).exists()  # a rerun into the same directory that succeeds is not failed


def test_what_is_not_an_exception_is_not_contained(tmp_path):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C ends the sweep, not one job
        run_sweep_job(interrupted, tmp_path)


def test_a_torn_outcome_file_is_skipped_naming_it(tmp_path, caplog):
    callback = SweepCallback()
    callback._sweep_started = 100.0
    for num, text in ((0, json.dumps({"num": 0, "started": 150.0, "status": "ok"})), (1, '{"num": 1, "sta')):
        (tmp_path / str(num) / ".hydra").mkdir(parents=True)
        (tmp_path / str(num) / ".hydra" / OUTCOME).write_text(text)
    with caplog.at_level(logging.WARNING):
        jobs = callback._outcomes(tmp_path)
    assert [job["num"] for job in jobs] == [0]
    assert f"1/.hydra/{OUTCOME}" in caplog.text
