"""WeightHandoff: weights pushed while an engine generates, handed to the generate call at its next decode step.

An engine that supports partial rollouts (``Engine.supports_partial_rollout``) takes two calls at a time: a
``generate`` call, and an ``update_weights`` that may arrive while it runs. Loading weights from the pushing
thread while the generating thread runs the model would race, so the push leaves the load here and waits; the
generate call takes it between two decode steps (where it also rebuilds whatever belongs to the old weights: the
key-value cache, the requests in flight) and the push returns once it has. Outside a generate call a push loads
at once. A push never waits longer than ``timeout_s`` (one decode step should take milliseconds).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class WeightHandoff:
    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # guards the fields below, held briefly (and while a load runs)
        self._generating = False
        self._pending: tuple[Callable[[], None], threading.Event, list] | None = None

    def load(self, apply: Callable[[], None], what: str) -> None:
        """Run ``apply`` (it loads the weights ``what``) now, or, during a generate call, at its next decode step;
        returns once it ran, raising what it raised."""
        with self._lock:
            if not self._generating:
                apply()
                return
            if self._pending is not None:  # superseded before a decode step took it: the newer weights win
                self._pending[1].set()
            done, errors = threading.Event(), []
            self._pending = (apply, done, errors)
        if not done.wait(self.timeout_s):
            with self._lock:
                if self._pending is not None and self._pending[1] is done:
                    self._pending = None  # withdrawn: a call that wakes later must not load them behind our back
            raise TimeoutError(f"the generate call under way did not take {what} within {self.timeout_s:g} s")
        if errors:
            raise errors[0]

    @contextmanager
    def generating(self) -> Iterator[None]:
        """The span of one generate call; weights pushed after its last decode step load when it ends."""
        with self._lock:
            if self._generating:
                raise RuntimeError("generate is already running: the engine pool sends an engine one call at a time")
            self._generating = True
        try:
            yield
        finally:
            with self._lock:
                self._generating = False
            self.take()

    def take(self, before: Callable[[], None] | None = None) -> bool:
        """Load the weights pushed during this call, if any, after ``before`` (which puts aside what belongs to the
        old ones); returns whether a push was taken (a load that failed included: the pusher raises its error, and
        the call rebuilds what ``before`` put aside under the weights it holds)."""
        with self._lock:
            if self._pending is None:
                return False
            apply, done, errors = self._pending
            self._pending = None
            try:
                if before is not None:
                    before()
                apply()
            except Exception as e:  # noqa: BLE001  (the pusher raises it; the call goes on with the old weights)
                errors.append(e)
        done.set()
        return True
