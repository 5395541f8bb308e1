"""Real process death (SIGKILL) of a cell through the whole stack, at before_forward, mid_forward_backward,
during_allreduce, after_vote, weight_sync and checkpoint_save (heal_send and heal_receive, phases inside torchft's
quorum, are killed for real in tests/ft/test_protocol.py): the run completes, every sample is trained exactly once
in a committed step, cells are bitwise equal after every step (heals included), and the final weights match a
failure-free run on the same data.

Several kills share one run: each hits its own step and cell incarnation, and the driver waits for the
replacement (``ft.await_replacement_s``) so it has healed before the next kill; each fault's own invariant is
checked on its own step. A kill that never fires fails the run (``UnfiredFaultError``), so none is skipped silently.

Why a tolerance against the failure-free run: after a death the survivors redo the step on a different split,
so fp32 sums run in another order; the differences stay at rounding level (1e-4 absolute bounds them here).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from harness import (CLASSIC2, CLASSIC2_MINIBATCHES, REFERENCE, SAMPLES_PER_STEP, STEPS, check_every_sample_once,
                     final_model, max_abs_diff, read_jsonl, run_rlfw)

from rlfw.checkpoint.layout import read_meta

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
FAULTS = ["dp=cells", *REFERENCE, "ft.await_replacement_s=60", "fault=kill_once"]


def kills(*schedule):
    """Overrides for a kill_once schedule of (cell, step, phase, incarnation[, stop seconds]) tuples; the first is
    incarnation 0. A fifth element makes that fault a stall (fault.signal=stop) of that many seconds."""
    (cell, step, phase, incarnation), *extra = schedule
    assert incarnation == 0

    def entry(c, s, p, i, stop_s=None):
        how = "" if stop_s is None else f", signal: stop, duration_s: {stop_s}"
        return f"{{cell: {c}, step: {s}, phase: {p}, incarnation: {i}{how}}}"

    extra_kills = ",".join(entry(*k) for k in extra)
    return [f"fault.cell={cell}", f"fault.step={step}", f"fault.phase={phase}", f"fault.extra_kills=[{extra_kills}]"]


def check_run(run_dir, reference_dir, steps_alone):
    """The invariants of every faulted run; ``steps_alone``: {step: the cells that trained that step between them}."""
    check_every_sample_once(run_dir)
    assert max_abs_diff(final_model(run_dir), final_model(reference_dir)) < 1e-4
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for step, cells in steps_alone.items():  # the dead cell's share was re-split over the survivors
        trained = {int(k.split("/")[1]) for k in rows[step] if k.startswith("cell/") and k.endswith("/num_samples")}
        assert trained == set(cells), (step, trained)
        assert sum(rows[step][f"cell/{c}/num_samples"] for c in cells) == SAMPLES_PER_STEP
    # a kill mid-save leaves complete checkpoints only
    assert all((p / "COMPLETE").exists() for p in (run_dir / "checkpoints").iterdir())
    return read_jsonl(run_dir / "events.jsonl")


def failed(events):
    return [(e["step"], e["cell"], e["incarnation"], e["phase"]) for e in events if e["kind"] == "cell_failed"]


def heal_steps(events):
    return sorted({e["step"] for e in events if e["kind"] == "heal"})


@pytest.fixture(scope="module")
def delayed_run(tmp_path_factory):
    """Two cells, split=delayed: a death before the forward and in the middle of the backward; the writer stalled
    (SIGSTOP, 20 s) in its weight export, past ft.stall_timeout_s; a death in the writer's checkpoint save; and a
    3 s stall after a vote, short of the stall timeout, which must cost nothing."""
    return run_rlfw(tmp_path_factory.mktemp("delayed"), *FAULTS, "dp.num_cells=2", "split=delayed", "logger=default",
                    "ft.stall_timeout_s=6",
                    *kills((1, 1, "before_forward", 0), (1, 3, "mid_forward_backward", 1),
                           (0, 5, "weight_sync", 0, 20), (0, 7, "checkpoint_save", 1), (1, 9, "after_vote", 2, 3)))


def test_kills_before_forward_mid_backward_and_in_the_writer(delayed_run, reference_run):
    events = check_run(delayed_run, reference_run(*CLASSIC2), steps_alone={1: [0], 3: [0], 9: [0, 1]})
    # (the save after step 7 is the checkpoint of 8 steps: its events are logged with step 8)
    assert [f[:3] for f in failed(events)] == [(1, 1, 0), (3, 1, 1), (5, 0, 0), (8, 0, 1)]
    [stalled] = [e for e in events if e["kind"] == "cell_failed" and e["step"] == 5]
    assert stalled["reason"].startswith("no heartbeat for") and stalled["call_elapsed_s"] < 20  # not its wake-up
    assert [(e["step"], e["cell"]) for e in events if e["kind"] == "cell_fenced"] == [(1, 1), (3, 1), (5, 0), (8, 0)]
    assert [(e["step"], e["phase"]) for e in events if e["kind"] == "writer_failover"] == [
        (5, "weight_sync"), (8, "checkpoint_save")]
    markers = sorted((delayed_run / "faults").glob("kill_*"))
    assert [json.loads(m.read_text())["signal"] for m in markers] == ["kill", "kill", "stop", "kill", "stop"]
    assert heal_steps(events) == [2, 4, 6, 8]  # each replacement healed from its live peer at the next step
    # the save that the writer died in was redone by the next writer and committed
    assert read_meta(delayed_run / "checkpoints" / "step_8")["step"] == 8


def test_report_of_a_run_with_failures(delayed_run):
    """``python -m rlfw.report`` on that run: the figure and its panels, the failures on the timeline."""
    from PIL import Image

    from rlfw.report.figures import DPI, RUN_FIGSIZE

    result = subprocess.run([sys.executable, "-m", "rlfw.report", str(delayed_run)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    with Image.open(delayed_run / "report" / "run.png") as image:
        assert image.format == "PNG" and image.size == (RUN_FIGSIZE[0] * DPI, RUN_FIGSIZE[1] * DPI)
    panels = {p["title"]: p for p in json.loads((delayed_run / "report" / "run.json").read_text())["panels"]}
    assert panels["Reward (mean ± std)"]["series"] == ["reward/mean", "± reward/std"]
    assert panels["Samples per replica"]["series"] == ["cell/0", "cell/1"]
    assert panels["Alive cells and quorum id"]["series"] == ["cells/alive", "ft/quorum_id"]
    kinds = list(dict.fromkeys(event["kind"] for event in read_jsonl(delayed_run / "events.jsonl")))
    assert panels["Events"]["series"] == kinds
    assert {"cell_failed", "quorum_change", "heal", "writer_failover"} <= set(kinds)


def test_kills_in_the_allreduce_and_after_the_vote_with_several_optimizer_steps(reference_run, tmp_path):
    """split=balanced, 3 optimizer steps per rollout (24 + 24 + 16 samples): a death inside the gradient
    all-reduce of the first minibatch, and one after the vote (the survivor commits that minibatch and trains
    the other two alone). ft.max_replacements=1: the second death gets no replacement, and the survivor trains
    every later step alone. The cells run colocated (``cluster.placement=colocated``): the survivor's optimizer
    state leaves between train calls and the replacement heals from it, and the final weights still match."""
    reference = reference_run(*CLASSIC2_MINIBATCHES)
    run_dir = run_rlfw(tmp_path / "run", *FAULTS, "dp.num_cells=2", "split=balanced", "algo.global_batch_size=24",
                       "ft.max_replacements=1", "cluster.placement=colocated",
                       *kills((1, 1, "during_allreduce", 0), (1, 3, "after_vote", 1)))
    events = check_run(run_dir, reference, steps_alone={1: [0], **{step: [0] for step in range(4, STEPS)}})
    assert [f[:3] for f in failed(events)] == [(1, 1, 0), (3, 1, 1)]
    assert heal_steps(events) == [2]
    spent = [e for e in events if e["kind"] == "replacement_budget_spent"]
    assert [(e["step"], e["cell"], e["max_replacements"], e["alive"]) for e in spent] == [(3, 1, 1, 1)]
    assert [e["incarnation"] for e in events if e["kind"] == "cell_replacement_started"] == [1]
    rows, ref_rows = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert all(r["train/optimizer_steps"] == 3 for r in rows)
    assert [r["cells/alive"] for r in rows[4:]] == [1] * (STEPS - 4) and rows[-1]["ft/replacements"] == 1
    # before any fault, the cells' balanced split computes the classic world's step
    assert math.isclose(rows[0]["loss"], ref_rows[0]["loss"], rel_tol=1e-6, abs_tol=1e-9)
    # after the vote: the dead cell's first minibatch is committed (its share is vouched for by the survivor)
    assert 0 < rows[3]["cell/0/num_samples"] < SAMPLES_PER_STEP
    assert any(e["kind"] == "resplit" and e["step"] == 1 for e in events)


def test_two_of_three_cells_die_in_one_allreduce_then_all_three_in_one_step(reference_run, tmp_path):
    """split=eager, 3 cells: two cells die inside one all-reduce; the last one trains the step alone on the union
    of the three planned parts, and both replacements heal from it at the next step. Against the two-replica
    reference: three cells sum the gradients in another order (round-off, as after every re-split).

    At step 5 all three die before the forward: no live cell holds the trained state, so the job restores its
    newest checkpoint (after step 3) by itself, redoes steps 4 and 5 on fresh cells, and ends where a run without
    faults ends.

    The deaths of a heal's sender and receiver are protocol phases: tests/ft/test_protocol.py kills them for real."""
    reference = reference_run(*CLASSIC2)
    run_dir = run_rlfw(tmp_path / "run", *FAULTS, "dp.num_cells=3", "split=eager",
                       *kills((1, 1, "during_allreduce", 0), (2, 1, "during_allreduce", 0),
                              (0, 5, "before_forward", 0), (1, 5, "before_forward", 1), (2, 5, "before_forward", 1)))
    events = check_run(run_dir, reference, steps_alone={1: [0]})
    assert sorted(f[:3] for f in failed(events)) == [(1, 1, 0), (1, 2, 0), (5, 0, 0), (5, 1, 1), (5, 2, 1)]
    assert [(e["step"], e["restored_step"]) for e in events if e["kind"] == "state_restored"] == [(5, 4)]
    assert [e["step"] for e in read_jsonl(run_dir / "ledger.jsonl.rewound")] == [4]  # committed, then lost
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(STEPS))
    assert heal_steps(events) == [2]
    assert sorted(e["cell"] for e in events if e["kind"] == "heal") == [1, 2]
    rows, ref_rows = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    # before any fault, three cells compute the two-replica step up to the order of the sum
    assert math.isclose(rows[0]["loss"], ref_rows[0]["loss"], rel_tol=1e-6, abs_tol=1e-9)
    assert all(len(e["weight_digests"]) == 3 for e in read_jsonl(run_dir / "ledger.jsonl")[2:])
