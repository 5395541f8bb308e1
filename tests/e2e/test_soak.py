"""Soak: random SIGKILLs at random phases over many steps. The run completes without a hang, every sample is
trained exactly once (the loop checks it every step), cells stay bitwise equal, and the reward still rises."""

import pytest
from harness import read_jsonl

pytestmark = pytest.mark.e2e


def test_random_kills_over_many_steps(run):
    steps = 30
    run_dir = run("soak", "dp=cells", "dp.num_cells=3", f"num_steps={steps}", "fault=random",
                  "fault.probability=0.01", "fault.seed=3", "ft.await_replacement_s=60",
                  "ft.verify_weights_every=1", "split=balanced", "rollout.num_prompts=16")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == steps
    failures = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "cell_failed"]
    assert len(failures) >= 2, "the seed was chosen so that several cells die"
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [e["sample_ids"] for e in ledger] == [list(range(s * 128, (s + 1) * 128)) for s in range(steps)]
    assert all(len(set(e["weight_digests"].values())) == 1 for e in ledger)
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last)
