"""RolloutQueue: the rollouts the driver has asked the manager for, and how far ahead of training they may run.

``loop=sync`` asks for step s's rollout when step s begins, with the weights step s trains from: the engines idle
while the trainer trains, and the trainer while the engines generate. ``loop=async`` with ``loop.max_staleness=k``
asks, when step s begins, for every rollout up to step s + k: the manager generates them one after the other, in
its ``rollout`` concurrency group, while the driver trains step s, and the weights each step pushes (the manager's
``weights`` group) reach the generation under way (partial rollouts, where the engine supports them).

**The staleness bound.** A rollout asked for while the engines hold version v has every token from version v or
newer (the pool checks it), and the step that trains on it, at most k steps later, holds at most v + k: no token
lags more than k versions behind the weights that train on it. ``staleness`` checks it per sample from the
versions the engines recorded per token, so a scheduling bug is an error, not a silently off-policy step. With
k = 0 this is the synchronous loop, call for call.

**Weight pushes.** ``push`` sends a step's new weights and returns at once: the manager loads them into the
engines (its ``weights`` group) while the driver logs, checkpoints and starts the next step. A rollout asked for
from that version waits for the load in the manager (``fill``), not in the driver; the next push waits for the one
before, so at most one is under way and they land in order.

**Utilisation.** The engines' busy fraction (engine seconds in generate calls over wall seconds times engines) and
the trainer's (seconds in log-probs and training over wall seconds) are what overlapping buys: both are measured
per step, in either mode.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, ObjectLostError

log = logging.getLogger(__name__)
# How many times a push whose weights were lost with the writer's node is exported again from the next writer.
MAX_REEXPORTS = 3


class StalenessError(RuntimeError):
    """A sample lags more policy versions behind the training weights than ``loop.max_staleness`` allows."""


def staleness(versions: List[List[int]], version: int, max_staleness: int,
              partial: Optional[List[bool]] = None) -> Dict[str, float]:
    """Per-sample staleness (``version`` minus the sample's oldest token version) summarised; above
    ``max_staleness`` it raises ``StalenessError`` naming the sample. ``partial``: per sample, whether weights
    changed inside one of its turns (an episode whose turns came from several versions is not a partial rollout
    when every change fell between two turns); None: a sample is one turn."""
    if not versions:
        return {}
    lags = np.asarray([version - min(v) for v in versions])
    if lags.max() > max_staleness or lags.min() < 0:
        worst = int(np.argmax(np.abs(lags)))
        raise StalenessError(
            f"sample {worst} has tokens of policy versions {sorted(set(versions[worst]))} but trains on version "
            f"{version}: {int(lags[worst])} versions apart, loop.max_staleness={max_staleness}"
        )
    return {
        "loop/staleness_max": float(lags.max()),
        "loop/staleness_mean": float(lags.mean()),
        # responses continued under newer weights than they started with
        "loop/partial_rollout_frac": float(np.mean(
            partial if partial is not None else [min(v) != max(v) for v in versions])),
    }


class RolloutQueue:
    """Steps whose rollout the manager was asked for, in order; ``max_staleness`` = how many steps ahead of the one
    training (0: none, the synchronous loop)."""

    def __init__(self, manager, max_staleness: int, num_steps: int, timeout_s: float) -> None:
        self.manager = manager
        self.max_staleness = max_staleness
        self.num_steps = num_steps
        self.timeout_s = timeout_s  # one rollout's wait (rollout.step_timeout_s)
        self._calls: Dict[int, ray.ObjectRef] = {}
        self._done: Dict[int, Dict[str, Any]] = {}  # answers fetched while counting what waits
        self._clock = (time.perf_counter(), 0.0)  # (wall, engine busy seconds) at the last utilisation
        # the push under way: (its call, its version, the export that made its weights, times exported again)
        self._push: Optional[Tuple[ray.ObjectRef, int, Callable[[], ray.ObjectRef], int]] = None
        self._pushed: Optional[int] = None  # the version of the last push sent
        self._landed: Optional[float] = None  # the seconds of the last push that landed, not reported yet

    def push(self, export: Callable[[], ray.ObjectRef], version: int, wait: bool = False) -> Dict[str, float]:
        """Send the engines the weights of ``version`` (``export()``: an object ref to the writer's copy), after the
        push before it has landed. ``wait``: return only once this one has landed too (the first weights; a restore
        to older ones, which no rollout may be asked for before). Returns ``time/weight_push_wait`` (the seconds the
        driver waited here) and ``time/weight_sync`` (the last landed push's own seconds in the manager), when there
        was one."""
        t0 = time.perf_counter()
        self.settle(superseded=True)
        self._send(export, version)
        if wait:
            self.settle()
        metrics = {"time/weight_push_wait": time.perf_counter() - t0}
        if self._landed is not None:
            metrics["time/weight_sync"], self._landed = self._landed, None
        return metrics

    def _send(self, export: Callable[[], ray.ObjectRef], version: int, tries: int = 0) -> None:
        self._push = (self.manager.update_weights.remote([export()], version), version, export, tries)
        self._pushed = version

    def settle(self, superseded: bool = False) -> None:
        """Wait for the push under way, if any, within the deadline, and raise its error; its seconds in the
        manager are reported by the next ``push``.

        The writer's copy of the weights lives in its node's object store until the manager has fetched it: a
        node lost in between loses the push (``ObjectLostError``). The trainers still hold those weights (no step
        trains while a rollout waits for them), so they are exported again, from the writer the train group has
        now, and sent again; ``superseded``: a newer version is about to be sent, which serves instead."""
        while self._push is not None:
            (call, version, export, tries), self._push = self._push, None
            try:
                self._landed = ray.get(call, timeout=self.timeout_s)
            except GetTimeoutError:
                raise TimeoutError(f"the push of weights v{version} to the engines did not finish within "
                                   f"rollout.step_timeout_s={self.timeout_s:g}") from None
            except ObjectLostError as error:
                if superseded:
                    log.warning("weights v%d were lost before the engines took them (%s); v%d follows", version,
                                type(error).__name__, version + 1)
                    return
                if tries >= MAX_REEXPORTS:
                    raise
                log.warning("weights v%d were lost before the engines took them (%s): exported again and re-sent",
                            version, type(error).__name__)
                self._send(export, version, tries + 1)

    def fill(self, step: int, version: int) -> None:
        """Ask for the rollouts of steps ``step`` .. ``step + max_staleness`` not asked for yet, from weights of
        ``version`` or newer; a push of ``version`` still under way is waited for in the manager."""
        wait_s = self.timeout_s if self._pushed is not None and self._pushed >= version else 0.0
        last = min(step + self.max_staleness, self.num_steps - 1)
        for s in range(step, last + 1):
            if s not in self._calls and s not in self._done:
                self._calls[s] = self.manager.generate.remote(s, version, wait_s)

    def take(self, step: int) -> Dict[str, Any]:
        """Step ``step``'s rollout (the manager's answer), waiting for it within the deadline; the seconds waited
        and the samples already generated for later steps are in its stats."""
        waiting = self._samples_waiting(step)
        t0 = time.perf_counter()
        rollout = self._done.pop(step) if step in self._done else self._wait(step, self._calls.pop(step))
        rollout["stats"]["loop/rollout_wait_s"] = time.perf_counter() - t0
        rollout["stats"]["loop/samples_waiting"] = waiting
        return rollout

    def _wait(self, step: int, call: ray.ObjectRef) -> Dict[str, Any]:
        """The rollout ``call``, within the deadline. A push under way is watched beside it: the rollout may be
        waiting for it in the manager, so a failed push raises here with its own error (not the rollout's timeout),
        and a push that lands late starts the rollout's deadline afresh."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            watched = [call] + ([self._push[0]] if self._push is not None else [])
            ready, _ = ray.wait(watched, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if call in ready:
                return ray.get(call)
            if not ready:
                raise TimeoutError(f"step {step}'s rollout did not finish within rollout.step_timeout_s="
                                   f"{self.timeout_s:g}")
            self.settle()  # the push landed first (or raises its error)
            deadline = time.monotonic() + self.timeout_s

    def _samples_waiting(self, step: int) -> int:
        """Samples generated for steps after ``step`` and not trained yet (their answers are fetched now)."""
        later = [s for s in self._calls if s > step]
        if later:
            ready, _ = ray.wait([self._calls[s] for s in later], num_returns=len(later), timeout=0)
            ready_set = set(ready)
            for s in later:
                if self._calls[s] in ready_set:
                    try:
                        self._done[s] = ray.get(self._calls[s])
                    except Exception:  # noqa: BLE001  (that step's own take raises it)
                        continue
                    del self._calls[s]
        return sum(len(r["batch"]) for s, r in self._done.items() if s > step)

    def utilisation(self, trainer_seconds: float, num_engines: int) -> Dict[str, float]:
        """Busy fractions of the engines and the trainer since the last call (the last step's end)."""
        now = time.perf_counter()
        busy = ray.get(self.manager.busy_seconds.remote(), timeout=self.timeout_s)
        wall = max(now - self._clock[0], 1e-9)
        engine = (busy - self._clock[1]) / (wall * max(num_engines, 1))
        self._clock = (now, busy)
        return {"loop/engine_busy_frac": engine, "loop/trainer_busy_frac": trainer_seconds / wall}

    def drain(self) -> None:
        """Wait for every rollout asked for (their errors ignored) and forget them: before the weights go back to
        an older version (a restore), whose generation must not mix with what was asked for from newer ones."""
        for call in self._calls.values():
            ray.cancel(call)  # a call still queued behind another never runs; the one running finishes
        deadline = time.monotonic() + self.timeout_s
        for call in self._calls.values():
            try:
                ray.get(call, timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001  (dropped either way; a hung manager fails the next step's wait)
                pass
        self._calls.clear()
        self._done.clear()
