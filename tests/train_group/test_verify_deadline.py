"""The cells' weight check (``ft.verify_weights_every``) is a call like any other: a cell stalled in it (a real
SIGSTOP) is failed at the phase's deadline and the check goes on with the others, instead of hanging the driver."""

import os
import signal
import threading

import ray

from rlfw.train_group.cell import CellState


def test_a_cell_stalled_in_the_weight_check_is_failed_not_waited_for(make_group):
    group, _ = make_group("dp=cells", "dp.num_cells=2", "ft.stall_timeout_s=2", "ft.min_phase_timeout_s=3",
                          "ft.replace_failed=false")
    first = group.weights_digests()
    assert sorted(first) == [0, 1] and first[0] == first[1]
    stalled = ray.get(group.roster.cells[1].world.workers[0].pid.remote(), timeout=60)
    os.kill(stalled, signal.SIGSTOP)
    try:
        answer = {}
        check = threading.Thread(target=lambda: answer.update(group.weights_digests()), daemon=True)
        check.start()
        check.join(timeout=120)
        assert not check.is_alive(), "the weight check waited for the stalled cell"
    finally:
        os.kill(stalled, signal.SIGCONT)
    assert answer == {0: first[0]}
    assert group.roster.cells[1].state is CellState.ERRORED and group.roster.failures == 1
