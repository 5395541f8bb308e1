"""The sweep's summary reads each job's outcome file: a torn one (left by an earlier sweep killed mid-write into
the same directory) is skipped with a warning, not the end of the summary."""

import json
import logging

from rlfw.run_files import OUTCOME
from rlfw.sweep import SweepCallback


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
