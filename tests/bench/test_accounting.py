"""``bench/restart_loop.account`` on a run directory written by hand: two jobs, one kill in each, the second job
restarted with its cells numbered afresh. The figures come out as worked out here from the records, not from the
bench's own arithmetic."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from restart_loop import Job, account  # noqa: E402

T0 = 1000.0


def write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run(tmp_path):
    """Job 0 starts at T0, trains steps 0-1 (lines at +21, +22), is killed at +22.5 in step 2 and ends at +23;
    job 1 starts at +24, resumes at step 2, trains steps 2-3 (lines at +46, +47), is killed at +47.2 in step 4
    (which it then finishes, line at +49) and ends at +50. Both kills hit cell 1, incarnation 0."""
    faults = tmp_path / "faults"
    faults.mkdir()
    for i, t in enumerate((T0 + 22.5, T0 + 47.2)):
        (faults / f"kill_{i}").write_text(json.dumps({"cell": 1, "incarnation": 0, "time": t, "step": 2 + 2 * i}))
    write_jsonl(tmp_path / "events.jsonl", [
        {"kind": "cell_failed", "cell": 1, "incarnation": 0, "detected_at": T0 + 22.55},  # job 0's
        {"kind": "cell_failed", "cell": 1, "incarnation": 0, "detected_at": T0 + 47.27},  # job 1's
    ])
    write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": s, "time/step": 1.0, "train/num_samples": 8} for s in range(5)])
    jobs = [Job(0, T0, T0 + 23, 75, [[0, T0 + 21], [1, T0 + 22]]),
            Job(1, T0 + 24, T0 + 50, 0, [[2, T0 + 46], [3, T0 + 47], [4, T0 + 49]], resumed_at=2)]
    return account("cells_no_replace", tmp_path, jobs)


def test_each_kill_pairs_with_its_own_detection(run):
    # a restarted job's cells reuse incarnation 0: the first detection after each kill, never another job's
    assert run["detect_s"] == pytest.approx([0.05, 0.07])


def test_ettr_over_the_wall_and_over_the_training_window(run):
    assert run["wall_s"] == pytest.approx(50.0)
    assert run["ettr"] == pytest.approx(5.0 / 50.0)
    # the window: the first step's start (its line at +21 less its 1 s) to the last line at +49
    assert run["ettr_training"] == pytest.approx(5.0 / 29.0)


def test_mttr_restarts_and_goodput(run):
    # kill -> next step line, less the median step: 46 - 22.5 - 1 and 49 - 47.2 - 1
    assert run["mttr_s"] == pytest.approx([22.5, 0.8])
    assert (run["failures"], run["restarts"], run["steps"], run["samples"]) == (2, 1, 5, 40)
    assert run["goodput"] == pytest.approx(40 / 50.0)
