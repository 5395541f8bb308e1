"""WeightHandoff: a push during a generate call is loaded by the call at its next decode step, and returns then;
outside a call it loads at once; a load's error reaches the pusher; a push past its deadline is withdrawn."""

import threading

import pytest

from rlfw.rollout.engines.handoff import WeightHandoff


def push_in_thread(handoff, loaded, version, errors):
    def push():
        try:
            handoff.load(lambda: loaded.append(version), f"weights v{version}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=push)
    thread.start()
    return thread


def wait_registered(handoff):
    while handoff._pending is None:
        threading.Event().wait(0.001)


def test_outside_a_call_a_push_loads_at_once():
    handoff, loaded = WeightHandoff(), []
    handoff.load(lambda: loaded.append(1), "weights v1")
    assert loaded == [1]


def test_during_a_call_the_call_loads_the_push_at_its_next_step_and_the_push_returns_then():
    handoff, loaded, errors = WeightHandoff(timeout_s=30), [], []
    with handoff.generating():
        assert not handoff.take()  # nothing pushed yet
        pusher = push_in_thread(handoff, loaded, 2, errors)
        wait_registered(handoff)
        assert loaded == [] and pusher.is_alive()  # waiting for the call
        before = []
        assert handoff.take(before=lambda: before.append(list(loaded)))
        pusher.join(10)
        assert not pusher.is_alive() and loaded == [2] and before == [[]]  # ``before`` ran first
    assert errors == []


def test_a_push_after_the_last_step_loads_when_the_call_ends():
    handoff, loaded, errors = WeightHandoff(timeout_s=30), [], []
    with handoff.generating():
        pusher = push_in_thread(handoff, loaded, 3, errors)
        wait_registered(handoff)
    pusher.join(10)
    assert loaded == [3] and errors == []


def test_a_failed_load_reaches_the_pusher_and_the_call_goes_on():
    handoff, errors = WeightHandoff(timeout_s=30), []

    def push():
        try:
            handoff.load(lambda: (_ for _ in ()).throw(ValueError("bad weights")), "weights v4")
        except ValueError as e:
            errors.append(e)

    with handoff.generating():
        pusher = threading.Thread(target=push)
        pusher.start()
        wait_registered(handoff)
        assert handoff.take()  # taken (and failed): the call rebuilds what ``before`` put aside
        pusher.join(10)
    assert [str(e) for e in errors] == ["bad weights"]


def test_a_push_past_its_deadline_is_withdrawn():
    handoff, loaded = WeightHandoff(timeout_s=0.05), []
    with handoff.generating():
        with pytest.raises(TimeoutError, match="did not take weights v5 within 0.05 s"):
            handoff.load(lambda: loaded.append(5), "weights v5")
        assert not handoff.take()  # nothing left to load behind the pusher's back
    assert loaded == []


def test_two_calls_at_once_are_refused():
    handoff = WeightHandoff()
    with handoff.generating():
        with pytest.raises(RuntimeError, match="already running"):
            with handoff.generating():
                pass
