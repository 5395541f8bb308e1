"""The driver's failure rules, without Ray: a clock of the test's own, the errors a call really ends in."""

import pytest
from omegaconf import OmegaConf
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from rlfw.config.schema import FTConfig
from rlfw.ft.errors import BelowMinCellsError, JobError, StateLostError
from rlfw.train_group.detector import HEARTBEAT_POLL_S, FailureDetector


class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self):
        return self.now


def detector(phase="train", deadline_s=10.0, **ft):
    clock = Clock()
    cfg = OmegaConf.structured(FTConfig(**{"stall_timeout_s": 3.0, "min_cells": 2, "replacement_deadline_s": 20.0,
                                           "max_replacements": 4, **ft}))
    return FailureDetector(phase, deadline_s, cfg, clock=clock), clock


def test_a_cell_whose_call_raised_or_whose_actor_died_is_failed_with_the_cause():
    rules, _ = detector()
    assert rules.failure(0, RayTaskError("train", "Traceback: boom", ValueError("boom"))) == "Traceback: boom"
    assert "before finishing" in rules.failure(1, RayActorError())
    lost = ObjectLostError("ab" * 14, None, "train")
    assert rules.failure(2, lost).startswith("its result was lost with its node: Failed to retrieve object")


def test_an_error_of_the_job_or_a_fatal_one_stops_the_run_instead():
    rules, _ = detector(phase="checkpoint_save")
    with pytest.raises(JobError, match="checkpoint_save failed on cell 1: OSError: .*No space left"):
        rules.failure(1, RayTaskError("save", "tb", OSError(28, "No space left on device")))
    with pytest.raises(StateLostError, match="nobody"):
        rules.failure(0, RayTaskError("train", "tb", StateLostError("nobody holds it")))


def test_a_silent_heartbeat_fails_a_cell_only_past_the_stall_timeout():
    rules, _ = detector()
    pending = {0: "cell_0:a", 1: "cell_1:b", 2: None}  # cell 2 has no replica id yet: never judged by heartbeat
    stalled = rules.stalled(pending, {"cell_0:a": 3.5, "cell_1:b": 2.9, "cell_0:old": 99.0})
    assert list(stalled) == [0] and "no heartbeat for 3.5 s, past ft.stall_timeout_s=3" in stalled[0]
    assert rules.stalled(pending, None) == {}  # the Lighthouse could not be read: nobody is declared stalled


def test_heartbeats_are_read_every_poll_interval():
    rules, clock = detector()
    assert not rules.heartbeat_due()
    clock.now += HEARTBEAT_POLL_S
    assert rules.heartbeat_due() and not rules.heartbeat_due()


def test_every_pending_cell_is_failed_once_the_call_runs_past_its_deadline():
    rules, clock = detector(phase="logprobs", deadline_s=10.0)
    clock.now += 10.0
    assert rules.overdue([0, 1]) == {}  # slow is not dead
    clock.now += 0.5
    overdue = rules.overdue([0, 1])
    assert sorted(overdue) == [0, 1] and "past the logprobs deadline of 10 s" in overdue[1]
    assert rules.elapsed() == 10.5


def test_below_min_cells_a_train_call_waits_for_replacements_only_while_one_can_come():
    rules, clock = detector(min_cells=2, replacement_deadline_s=20.0)
    assert not rules.rescue(left=2, replacements_coming=False)  # enough cells: nothing to do
    assert rules.rescue(left=1, replacements_coming=True)  # send the call to each replacement once ready
    with pytest.raises(BelowMinCellsError, match="no replacement can come .*ft.max_replacements=4"):
        rules.rescue(left=1, replacements_coming=False)
    clock.now += 20.5
    with pytest.raises(BelowMinCellsError, match="within ft.replacement_deadline_s=20.0"):
        rules.rescue(left=1, replacements_coming=True)
