"""The replacement policy of cells: a budget over the run, a backoff for a cell id that keeps failing."""

from rlfw.train_group.replacements import MAX_BACKOFF_S, ReplacementPolicy


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_first_failure_is_replaced_at_once_and_repeated_ones_back_off():
    clock = Clock()
    policy = ReplacementPolicy(True, -1, backoff_s=1.0, clock=clock)
    assert policy.on_failure(1) == 100.0
    policy.on_started()
    assert [policy.on_failure(1) for _ in range(3)] == [101.0, 102.0, 104.0]  # died again before committing
    assert policy.on_failure(0) == 100.0  # another cell id has its own streak
    for _ in range(10):
        policy.on_failure(1)
    assert policy.on_failure(1) == 100.0 + MAX_BACKOFF_S
    policy.on_committed(1)  # its replacement trained: the next failure is a new one
    assert policy.on_failure(1) == 100.0


def test_past_the_budget_no_replacement_comes():
    policy = ReplacementPolicy(True, 2, backoff_s=0.0, clock=Clock())
    for cell in (0, 1):
        assert policy.on_failure(cell) is not None
        policy.on_started()
    assert not policy.budget_left() and policy.on_failure(0) is None and policy.started == 2


def test_a_failure_that_is_not_started_costs_nothing():
    # a replacement waiting for room (or in its backoff) is not counted: only started ones are
    policy = ReplacementPolicy(True, 1, backoff_s=0.0, clock=Clock())
    assert policy.on_failure(0) is not None and policy.on_failure(0) is not None and policy.budget_left()


def test_replacements_off_or_a_zero_budget_replace_nothing():
    assert ReplacementPolicy(False, -1, 1.0).on_failure(0) is None
    assert ReplacementPolicy(True, 0, 1.0).on_failure(0) is None


def test_a_scheduled_replacement_is_due_after_its_backoff_once():
    clock = Clock()
    policy = ReplacementPolicy(True, -1, backoff_s=2.0, clock=clock)
    assert policy.schedule(0, incarnation=1) and policy.due() == [(0, 1)] and not policy.waiting()
    policy.on_started()
    assert policy.schedule(0, incarnation=2)  # failed again before committing: 2 s of backoff
    assert policy.waiting() and policy.due() == []
    clock.now += 2.0
    assert policy.due() == [(0, 2)] and policy.due() == []
    assert not ReplacementPolicy(False, -1, 1.0).schedule(0, 1)
    policy.schedule(1, 1)
    policy.clear()
    assert not policy.waiting() and policy.due() == []
