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


def test_join_retry_and_straggler_grace_have_their_own_keys():
    cfg = load("ft.join_retry_s=7", "ft.straggler_grace_s=9")
    assert (cfg.ft.join_retry_s, cfg.ft.straggler_grace_s, cfg.ft.heartbeat_timeout_s) == (7, 9, 2)
