"""Slow is not dead, a stalled cell is fenced, a rescue joins mid-call: CellSync and the step loop against real
torchft, one spawned process per cell, stalls by real SIGSTOP from outside the cell (rlfw.ft.stopper).

Each scenario trains RL step 0 as two minibatches (two optimizer steps in one call) and stops or kills cell 1 right
after its vote on the first, so the second minibatch's quorum is where a slow, stalled or replaced cell shows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from protocol_harness import Cluster, assert_bitwise_equal, minibatches, reference

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)


def stop_cell_1(duration_s):
    return dict(kind="kill_once", cell=1, step=0, phase="after_vote", signal="stop", duration_s=duration_s)


def committed(result):
    return [a for a in result["attempts"] if a["committed"]]


def assert_same_weights(a, b):
    for key in ("weights", "optimizer"):
        assert_bitwise_equal(a[key], b[key], key)


@pytest.fixture(scope="module")
def short_stop(tmp_path_factory):
    """Cell 1 is stopped for 3 s: past the Lighthouse's heartbeat timeout (2 s: the Lighthouse forms quorums
    without it meanwhile), short of the driver's ft.stall_timeout_s (6 s)."""
    run_dir = tmp_path_factory.mktemp("short_stop")
    with Cluster(run_dir, stop_cell_1(3.0), watch_heartbeats=True, stall_timeout_s=6.0) as cluster:
        cells = cluster.spawn(0, 1)
        results = cluster.train(cells, 0, per_step=2)
        return SimpleNamespace(results=results, taken_out=list(cluster.taken_out), run_dir=run_dir)


@pytest.fixture(scope="module")
def long_stop(tmp_path_factory):
    """Cell 1 is stopped for 10 s, past ft.stall_timeout_s (4 s): the driver takes it out of the call and fences it,
    but (as across a partition) cannot kill it. When it wakes it must be refused, not heal or take a share."""
    run_dir = tmp_path_factory.mktemp("long_stop")
    with Cluster(run_dir, stop_cell_1(10.0), watch_heartbeats=True) as cluster:
        cells = cluster.spawn(0, 1)
        step0 = cluster.train(cells, 0, per_step=2)
        taken_out = list(cluster.taken_out)
        step1 = cluster.train(cells[:1], 1, per_step=2)  # the survivor alone while the fenced process wakes
        woken = cells[1]
        try:
            woken.receive(deadline=time.monotonic() + 30)
            refusal = None
        except RuntimeError as e:
            refusal = str(e)
        return SimpleNamespace(step0=step0, step1=step1, taken_out=taken_out, refusal=refusal,
                               rejections=cluster.membership.new_rejections(), alive=woken.process.is_alive())


@pytest.fixture(scope="module")
def rescue(tmp_path_factory):
    """ft.min_cells=2: cell 1 is killed after its vote on the first minibatch, so the survivor cannot go on alone;
    a replacement is sent the same call (both minibatches) while the survivor waits at the second."""
    run_dir = tmp_path_factory.mktemp("rescue")
    fault = dict(kind="kill_once", cell=1, step=0, phase="after_vote")
    with Cluster(run_dir, fault, min_cells=2, quorum_timeout_s=90.0) as cluster:
        cells = cluster.spawn(0, 1)
        call = cluster.dispatch(cells, 0, per_step=2)
        cells[1].process.join(timeout=60)  # the kill
        [replacement] = cluster.spawn(1, incarnation=1)
        call.add(replacement)
        results = call.collect()
        return SimpleNamespace(results=results, exitcode=cells[1].exitcode)


def test_a_cell_stopped_shorter_than_the_stall_timeout_costs_nothing(short_stop):
    """The survivor waits for it: both minibatches commit with both cells, bitwise equal to a fault-free run."""
    marker = json.loads((Path(short_stop.run_dir) / "faults" / "kill_0").read_text())
    assert (marker["cell"], marker["signal"]) == (1, "stop")
    assert short_stop.taken_out == []
    ref = reference([2, 2], per_step=2)
    for result in short_stop.results:
        assert [a["num_participants"] for a in committed(result)] == [2, 2]
        assert [r["minibatch_index"] for r in result["records"]] == [0, 1]
        assert_same_weights(result["after"], ref[1])


def test_a_cell_stalled_past_the_stall_timeout_is_fenced_and_refused_when_it_wakes(long_stop):
    survivor, stalled = long_stop.step0
    assert stalled is None and [p.cell for p in long_stop.taken_out] == [1]
    assert [a["num_participants"] for a in committed(survivor)] == [2, 1]  # the second minibatch alone
    assert sorted(i for a in committed(survivor) for i in a["sample_ids"]) == sorted(
        minibatches(0, 2)[0].sample_ids[0::2] + minibatches(0, 2)[1].sample_ids)
    [alone] = long_stop.step1
    assert [a["num_participants"] for a in committed(alone)] == [1, 1]
    assert_same_weights(alone["after"], reference([2, 1, 1, 1], per_step=2)[3])  # nothing of the woken cell in it
    assert long_stop.refusal is not None and "FencedError" in long_stop.refusal
    assert long_stop.rejections and long_stop.rejections[0][:2] == (1, 0)
    assert long_stop.alive  # refused, not killed: fencing alone kept it out


def test_a_replacement_sent_the_whole_call_joins_the_survivor_at_its_minibatch(rescue):
    """The replacement heals (cursor: minibatch 0 committed) and trains minibatch 1 only, with the survivor."""
    survivor, dead, replacement = rescue.results
    assert rescue.exitcode == -9 and dead is None and replacement is not None
    assert [r["minibatch_index"] for r in survivor["records"]] == [0, 1]
    assert [r["minibatch_index"] for r in replacement["records"]] == [1]
    [healed] = committed(replacement)
    assert "heal_time" in healed["info"] and healed["num_participants"] == 2
    mb1 = minibatches(0, 2)[1]
    assert sorted(committed(survivor)[-1]["sample_ids"] + healed["sample_ids"]) == sorted(mb1.sample_ids)
    assert_same_weights(replacement["after"], survivor["after"])
    assert_same_weights(survivor["after"], reference([2, 2], per_step=2)[1])
    assert replacement["after"]["cursor"] == survivor["after"]["cursor"] == {
        "rl_step": 0, "minibatch_index": 1, "optimizer_steps": 2}
