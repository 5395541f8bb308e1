"""The rules between the fault-tolerance timeouts (README, "Timeouts"): a config that would let survivors time out
while the driver still waits for a replacement, or before a dead cell's heartbeat lapses, fails before Ray starts,
naming both keys."""

import pytest
from test_config import load

from rlfw.config import ConfigError, validate


def test_survivors_wait_longer_in_their_quorum_than_the_driver_waits_for_a_replacement():
    # the reproduction: ft.min_cells=2, a kill, a replacement slower than 3 s -> every survivor timed out
    with pytest.raises(ConfigError, match=r"ft\.quorum_timeout_s=3.*ft\.replacement_deadline_s=120"):
        validate(load("ft.min_cells=2", "ft.quorum_timeout_s=3", "ft.await_replacement_s=120"))


@pytest.mark.parametrize("quorum", [2.0, 2.4, 2.5])
def test_a_quorum_outlasts_the_heartbeat_and_join_window_that_drop_a_dead_cell(quorum):
    with pytest.raises(ConfigError, match=rf"ft\.quorum_timeout_s={quorum:g} .*ft\.heartbeat_timeout_s=2 \+ "
                                          r"ft\.join_timeout_s=0\.5"):
        validate(load(f"ft.quorum_timeout_s={quorum}", "ft.heartbeat_timeout_s=2", "ft.join_timeout_s=0.5"))
    validate(load("ft.quorum_timeout_s=2.6", "ft.heartbeat_timeout_s=2", "ft.join_timeout_s=0.5"))


def test_the_defaults_follow_the_rules_with_several_required_cells():
    validate(load("ft.min_cells=2"))


def test_stall_and_phase_deadlines_have_their_own_keys():
    cfg = load("ft.stall_timeout_s=7", "ft.min_phase_timeout_s=90", "ft.phase_timeout_factor=3")
    assert (cfg.ft.stall_timeout_s, cfg.ft.min_phase_timeout_s, cfg.ft.phase_timeout_factor,
            cfg.ft.heartbeat_timeout_s) == (7, 90, 3, 1)


@pytest.mark.parametrize("phase_min", [10.0, 15.0])
def test_a_phase_deadline_never_fires_before_a_stalled_heartbeat_would(phase_min):
    with pytest.raises(ConfigError, match=rf"ft\.min_phase_timeout_s={phase_min:g} .*ft\.stall_timeout_s=15"):
        validate(load(f"ft.min_phase_timeout_s={phase_min}", "ft.stall_timeout_s=15"))
    validate(load("ft.min_phase_timeout_s=15.5", "ft.stall_timeout_s=15"))


def test_a_first_call_gets_at_least_the_phase_minimum_and_the_factor_is_at_least_one():
    with pytest.raises(ConfigError, match=r"ft\.first_call_timeout_s=30 .*ft\.min_phase_timeout_s=60"):
        validate(load("ft.first_call_timeout_s=30"))
    with pytest.raises(ConfigError, match=r"ft\.phase_timeout_factor=0\.5"):
        validate(load("ft.phase_timeout_factor=0.5"))


@pytest.mark.parametrize("override, message", [
    ("fault.signal=pause", r"fault\.signal='pause' is not one of \['kill', 'stop'\]"),
    ("fault.signal=stop", r"fault\.signal='stop' needs fault\.duration_s > 0"),
    ("+fault.extra_kills=[{cell:0,step:1,phase:after_vote,signal:stop}]",
     r"fault\.extra_kills\[0\]\.signal='stop' needs fault\.extra_kills\[0\]\.duration_s > 0"),
])
def test_a_stop_needs_a_duration(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load("fault=kill_once", override))
