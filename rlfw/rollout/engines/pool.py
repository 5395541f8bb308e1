"""EnginePool: the engine actors of a run, the requests spread over them, and their replacement when one dies.

Requests go out in chunks: every engine holds at most one call of at most ``max_inflight`` requests, and gets the
next chunk when it answers, so a fast engine takes more of the work and no engine queues more than the limit
(memory, latency of a weight update). When an engine's actor dies (its process was killed, ran out of memory,
crashed in native code), the pool starts a new one in its slot, loads the current weights into it *before* it
serves, and sends the dead engine's chunk out again. After ``max_restarts`` restarts over the pool's life a dead
engine is retired instead: the pool goes on with the engines still serving (a run loses throughput, not its
progress), and only when none is left does it give up with ``EngineRestartsExhausted``. A retried chunk is the
same requests with the same seed, so a death does not change what a seeded step samples. Every token of a response
must come from weights no older than the caller's ``min_version`` (by default the version current when the call
starts) and no newer than the last pushed: anything else raises ``StaleWeightsError`` rather than reach the trainer.

The driver's weight pushes reach ``update_weights`` from another thread while ``generate`` is under way (the
manager's two concurrency groups; in either loop, since the driver does not wait for a push): the slots, the
restart count and the weights the pool holds are guarded by one lock, which no start or load is waited for under;
an engine replaced by one thread is not replaced again by the other, which waits for that replacement instead.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rlfw.rollout.types import Generation, SamplingParams

log = logging.getLogger("rlfw.rollout")

REPLACED_POLL_S = 1.0  # how often a rollout looks whether a slot replaced in the background serves again


class EngineRestartsExhausted(RuntimeError):
    """The last serving engine died and the pool may not restart another one."""


class StaleWeightsError(RuntimeError):
    """A response was generated with other weights than the caller expects."""


def chunk_params(params: SamplingParams, chunk: list[int]) -> SamplingParams:
    """A seeded call's chunk gets a seed of its own, derived from the call's and the chunk's first request: the
    chunks (hence the responses) do not depend on which engine serves them, or on an engine's death."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=int(np.random.SeedSequence([params.seed, chunk[0]]).generate_state(1)[0]))


class EnginePool:
    """``start_engine(index, incarnation)`` returns a new engine actor for slot ``index`` (its ``incarnation``-th
    start); ``max_inflight`` = 0 sends every engine an equal share in one call."""

    def __init__(
        self, start_engine: Callable[[int, int], Any], num_engines: int, max_inflight: int, max_restarts: int,
        call_timeout_s: float = 1800.0, start_timeout_s: float = 600.0,
    ) -> None:
        self._start_engine = start_engine
        self.max_inflight = max_inflight
        self.max_restarts = max_restarts
        self.call_timeout_s = call_timeout_s  # one generate or weight-load call; past it the engine counts as hung
        self.start_timeout_s = start_timeout_s  # a new engine's process start, added to its first call's deadline
        self.replacement_timeout_s = start_timeout_s + call_timeout_s  # all the tries of one slot's replacement
        self.incarnations = [0] * num_engines
        self.engines = [start_engine(i, 0) for i in range(num_engines)]  # None: a slot retired past the budget
        self.restarts = 0
        self.retired: list[int] = []
        # The weights every engine must hold: (object ref, version); None before the first update.
        self._weights: tuple[ray.ObjectRef, int] | None = None
        self._lock = threading.RLock()  # engines, restarts and weights, between the generate and weights threads
        # The version of the last push every serving engine loaded (None before one), or how the last push failed:
        # what a generate call that needs a version still being pushed waits for (``wait_loaded``).
        self._loaded: int | None = None
        self._push_error: tuple[int, str] | None = None
        self._loaded_changed = threading.Condition(self._lock)
        self._closing = False  # set by shutdown: no engine is replaced any more
        self._replacing: set[int] = set()  # slots whose replacement is under way (they do not serve meanwhile)
        self._starting: dict[int, Any] = {}  # the actor each of those is starting: shutdown ends it too
        self._slots_changed = threading.Condition(self._lock)  # a replacement ended: its slot serves or is retired
        self._background_error: BaseException | None = None  # how the last replacement in the background failed
        # Engine seconds spent in generate calls: finished calls, and the start of each engine's call under way.
        # A lock of their own: the driver reads them every step, whatever the other threads hold.
        self._busy_lock = threading.Lock()
        self._busy_total = 0.0
        self._busy_since: dict[int, float] = {}

    @property
    def weight_version(self) -> int | None:
        return None if self._weights is None else self._weights[1]

    def num_alive(self) -> int:
        """Engines serving: every slot but the retired ones."""
        return len(self.engines) - len(self.retired)

    def _serving(self) -> list[int]:
        """The slots that take calls (under the lock): neither retired nor being replaced."""
        return [i for i, engine in enumerate(self.engines) if engine is not None and i not in self._replacing]

    def _await_serving(self) -> list[int]:
        """The serving slots, once any serves or no replacement is under way (within one replacement's bound)."""
        with self._slots_changed:
            self._slots_changed.wait_for(lambda: self._serving() or not self._replacing or self._closing,
                                         timeout=self.replacement_timeout_s)
            return self._serving()

    def busy_seconds(self) -> float:
        """Engine seconds spent generating since the pool started (calls under way count up to now)."""
        with self._busy_lock:
            now = time.monotonic()
            return self._busy_total + sum(now - since for since in self._busy_since.values())

    def update_weights(self, hf_state, version: int) -> None:
        """Load ``hf_state`` (a dict or its object ref) into every engine; a dead engine is replaced and loaded.
        An engine that is generating takes them between two decode steps (partial rollouts) or, without that, once
        its call under way returns."""
        try:
            ref = hf_state if isinstance(hf_state, ray.ObjectRef) else ray.put(hf_state)
            # A copy on this node, not deserialized: a replacement engine may need these weights after the writer's
            # node is gone, and Ray recovers a lost object from any copy left. Without it the engines still load
            # them from the writer's copy (each call has its own deadline).
            copied, _ = ray.wait([ref], fetch_local=True, timeout=self.call_timeout_s)
            if not copied:
                log.warning("weights v%d not copied to the rollout manager's node within %.0f s: a replacement engine "
                            "will need the writer's copy", version, self.call_timeout_s)
            with self._lock:
                self._weights = (ref, version)
                engines = {index: self.engines[index] for index in self._serving()}
            calls = {index: engine.update_weights.remote(ref, version) for index, engine in engines.items()}
            for index, call in calls.items():
                try:
                    ray.get(call, timeout=self.call_timeout_s)
                except (RayActorError, RayTaskError, GetTimeoutError) as e:
                    # dead, hung, or its load failed (a handoff that timed out included): a fresh engine loads them,
                    # and the same load failing there is the run's error
                    self._restart(index, e, engines[index])
        except BaseException as e:
            with self._loaded_changed:  # the message only: the exception's frames would hold the weights
                self._push_error = (version, f"{type(e).__name__}: {e}")
                self._loaded_changed.notify_all()
            raise
        with self._loaded_changed:
            self._loaded, self._push_error = version, None
            self._loaded_changed.notify_all()

    def wait_loaded(self, version: int, timeout_s: float) -> None:
        """Return once every serving engine holds weights of ``version`` or newer (the last push loaded), waiting up
        to ``timeout_s`` for a push under way in another thread; else raise, naming what the engines hold. A caller
        that pushes an older version (a restore) waits for that push itself before it asks for generations."""
        deadline = time.monotonic() + timeout_s
        with self._loaded_changed:
            while self._loaded is None or self._loaded < version:
                if self._closing:
                    raise RuntimeError(f"the engine pool shut down while waiting for weights v{version}")
                if self._push_error is not None and self._push_error[0] >= version:
                    failed, cause = self._push_error
                    raise RuntimeError(f"the push of weights v{failed} failed: {cause}")
                left = deadline - time.monotonic()
                if left <= 0:
                    waited = f" (waited {timeout_s:g} s for a push)" if timeout_s > 0 else ""
                    raise RuntimeError(f"engines hold weights v{self._loaded} but v{version} or newer is needed"
                                       f"{waited}")
                self._loaded_changed.wait(left)

    def health(self, timeout_s: float, wait: bool = True) -> list[dict[str, Any]]:
        """The health answer of each serving engine; one that is dead or does not answer in ``timeout_s`` is
        replaced (or retired past the restart budget, and then left out). ``wait=False``: the replacement goes on
        in the background and its slot is left out (a rollout about to start, which serves on with the others);
        with ``wait``, replacements already under way are waited for first, so that every slot answers."""
        with self._slots_changed:
            if wait:
                self._slots_changed.wait_for(lambda: not self._replacing or self._closing,
                                             timeout=self.replacement_timeout_s)
            engines = {index: self.engines[index] for index in self._serving()}
        calls = {index: engine.health.remote() for index, engine in engines.items()}
        answers = []
        for index, call in calls.items():
            try:
                answers.append(ray.get(call, timeout=timeout_s))
            except (RayActorError, GetTimeoutError) as e:
                if self._restart(index, e, engines[index], wait=wait):
                    with self._lock:
                        replacement = self.engines[index]
                    try:
                        if replacement is not None:  # (retired by the other thread meanwhile)
                            answers.append(ray.get(replacement.health.remote(), timeout=timeout_s))
                    except (RayActorError, GetTimeoutError) as again:  # the next call that reaches it replaces it
                        log.warning("rollout engine %d's replacement did not answer its health check: %s", index,
                                    str(again).splitlines()[0])
        return answers

    def generate(
        self, requests: list[list[int]], params: SamplingParams, min_version: int | None = None
    ) -> list[Generation]:
        """One response per request, in order, every token from weights of version ``min_version`` or newer
        (None: the weights of the last ``update_weights``, which a synchronous caller does not change meanwhile)."""
        if self._weights is None:
            raise RuntimeError("EnginePool.generate called before update_weights: the engines hold no policy")
        min_version = self.weight_version if min_version is None else min_version
        # Chunks are cut by the configured engine count, not the serving one: a retired engine changes who serves a
        # chunk, never the chunks (or their seeds), so a seeded step samples the same responses.
        chunk_size = self.max_inflight or max(1, math.ceil(len(requests) / len(self.engines)))
        pending = deque(range(len(requests)))
        results: list[Generation | None] = [None] * len(requests)
        # call -> (engine slot, its actor, the chunk, the deadline)
        inflight: dict[ray.ObjectRef, tuple[int, Any, list[int], float]] = {}
        idle: deque[int] = deque()
        try:
            while pending or inflight:
                with self._lock:  # every serving slot without a call of this rollout: one replaced meanwhile too
                    calling = {index for index, *_ in inflight.values()}
                    idle.extend(i for i in self._serving() if i not in idle and i not in calling)
                    replacing = bool(self._replacing)
                while idle and pending:
                    index = idle.popleft()
                    with self._lock:
                        engine = self.engines[index]
                    if engine is None:  # retired by the weights thread meanwhile
                        continue
                    with self._busy_lock:
                        self._busy_since[index] = time.monotonic()
                    chunk = [pending.popleft() for _ in range(min(chunk_size, len(pending)))]
                    call = engine.generate.remote([requests[i] for i in chunk], chunk_params(params, chunk))
                    inflight[call] = (index, engine, chunk, time.monotonic() + self.call_timeout_s)
                if not inflight:  # requests left and no call out: wait for a replacement under way, if any
                    idle.extend(self._await_serving())
                    if idle:
                        continue
                    cause = self._background_error
                    raise EngineRestartsExhausted(
                        f"no rollout engine is left to serve {len(pending)} requests: " + (
                            str(cause) if cause is not None else
                            f"the rollout.max_engine_restarts={self.max_restarts} restarts are used up")) from cause
                first_deadline = min(deadline for *_, deadline in inflight.values())
                wait_s = max(0.0, first_deadline - time.monotonic())
                ready, _ = ray.wait(list(inflight), num_returns=1,
                                    timeout=min(wait_s, REPLACED_POLL_S) if replacing else wait_s)
                if not ready and time.monotonic() < first_deadline:
                    continue  # a look whether a slot being replaced serves again
                if not ready:  # the oldest call is past its deadline: its engine hangs
                    done = min(inflight, key=lambda ref: inflight[ref][3])
                    index, engine, chunk, _ = inflight.pop(done)
                    self._call_ended(index)
                    pending.extendleft(reversed(chunk))
                    hung = GetTimeoutError(
                        f"engine {index} did not answer a generate call within {self.call_timeout_s} s")
                    self._restart(index, hung, engine, wait=False)  # serves this rollout again once replaced
                    continue
                [done] = ready
                index, engine, chunk, _ = inflight.pop(done)
                self._call_ended(index)
                try:
                    generations = ray.get(done)
                except RayActorError as e:
                    pending.extendleft(reversed(chunk))  # first in line again, on whichever engine is free next
                    self._restart(index, e, engine, wait=False)
                    continue
                idle.append(index)
                for i, generation in zip(chunk, generations):
                    self._check_version(index, generation, min_version)
                    results[i] = generation
        finally:
            for index, *_ in inflight.values():  # calls an error left behind: no longer counted as busy
                self._call_ended(index)
        return results  # type: ignore[return-value]  (every slot is filled once the queue is empty)

    def _call_ended(self, index: int) -> None:
        with self._busy_lock:
            self._busy_total += time.monotonic() - self._busy_since.pop(index)

    def shutdown(self) -> None:
        """Let every live engine release what it started, within one ``call_timeout_s`` for all, then end every
        actor, whatever its release did. A generate call still under way in another thread (a rollout asked for
        ahead, in loop=async) fails instead of replacing them."""
        with self._loaded_changed:
            self._closing = True
            self._loaded_changed.notify_all()  # a generate call waiting for a push gives up
            self._slots_changed.notify_all()
            engines = [self.engines[index] for index in self._serving()] + list(self._starting.values())
        calls = [engine.shutdown.remote() for engine in engines]
        deadline = time.monotonic() + self.call_timeout_s
        for engine, call in zip(engines, calls):
            try:
                ray.get(call, timeout=max(0.0, deadline - time.monotonic()))
            except (RayActorError, GetTimeoutError):
                pass  # dead or hung: the kill below ends it
            except RayTaskError as e:  # its release failed: said, and the kill below ends it all the same
                log.warning("a rollout engine's shutdown failed: %s", str(e).splitlines()[0])
            ray.kill(engine)

    def _check_version(self, index: int, generation: Generation, min_version: int) -> None:
        newest = self.weight_version
        versions = generation.versions()
        if any(v is None or not min_version <= v <= newest for v in versions):
            wanted = f"v{newest}" if min_version == newest else f"v{min_version}..v{newest}"
            got = ", ".join(f"v{v}" for v in sorted(set(versions), key=str))
            raise StaleWeightsError(f"engine {index} answered with weights {got}, expected {wanted}")

    def _restart(self, index: int, cause: Exception, failed: Any, wait: bool = True) -> bool:
        """Replace engine ``index`` (the actor ``failed``) and load the current weights into it before it serves
        anything; past the restart budget, retire the slot instead. Returns whether the slot serves again.

        The replacement starts and loads outside the pool's lock, so the other engines go on serving meanwhile (a
        start can wait minutes for room on a node), and the slot serves nothing until it is done. A thread that
        meets the same failed actor meanwhile does not start a second replacement: with ``wait`` it waits for the
        first; without (a rollout, which serves on with its other engines) it returns False at once, and so does a
        replacement it starts, which then runs in a thread of its own."""
        with self._lock:
            self._refuse_if_closing(index, cause)
            mine = index not in self._replacing
            if mine:
                if self.engines[index] is not failed:  # replaced or retired by another thread already
                    return self.engines[index] is not None
                self._replacing.add(index)
        if mine and wait:
            return self._replace(index, cause, failed)
        if mine:
            threading.Thread(target=self._replace_in_background, args=(index, cause, failed), daemon=True,
                             name=f"replace-engine-{index}").start()
            return False
        if not wait:
            return False
        with self._slots_changed:
            self._slots_changed.wait_for(lambda: index not in self._replacing,
                                         timeout=self.replacement_timeout_s)  # its own bound
            return index in self._serving()

    def _refuse_if_closing(self, index: int, cause: Exception) -> None:
        """Under the pool's lock: once shutdown began, no engine is replaced any more."""
        if self._closing:
            raise RuntimeError(f"rollout engine {index} stopped: the engine pool is shutting down") from cause

    def _replace_in_background(self, index: int, cause: Exception, failed: Any) -> None:
        try:
            self._replace(index, cause, failed)
        except BaseException as e:  # noqa: BLE001 - the rollout that handed it off finds the slot retired or dead
            self._background_error = e  # what a rollout left without engines names as the cause
            log.log(logging.INFO if self._closing else logging.WARNING, "rollout engine %d was not replaced: %s: %s",
                    index, type(e).__name__, str(e).splitlines()[0] if str(e) else "")

    def _replace(self, index: int, cause: Exception, failed: Any) -> bool:
        """Start engines for slot ``index`` (in ``_replacing``) until one answers and holds the pool's weights,
        within one ``replacement_timeout_s`` for all the tries (a replacement that cannot be placed, its
        node gone and no room left, must not keep the slot waiting for the whole restart budget); else retire the
        slot. The slot is swapped, under the lock, only once the replacement holds the weights the pool holds at
        that moment: a push that came meanwhile is loaded too before it serves. Every actor started here and not
        swapped in is ended."""
        deadline = time.monotonic() + self.replacement_timeout_s
        try:
            ray.kill(failed)  # a hung engine must not come back as a twin
            while True:
                left = deadline - time.monotonic()
                with self._lock:
                    if self.restarts >= self.max_restarts or left <= 0 or self._closing:
                        return self._retire(index, cause)
                    self.restarts += 1
                    self.incarnations[index] += 1
                    incarnation = self.incarnations[index]
                engine = self._start_engine(index, incarnation)
                try:
                    if self._swap_in_when_loaded(index, engine, cause, left, deadline):
                        return True
                except (RayActorError, GetTimeoutError) as e:
                    cause = e
        finally:
            with self._slots_changed:
                self._replacing.discard(index)
                self._starting.pop(index, None)
                self._slots_changed.notify_all()

    def _swap_in_when_loaded(self, index: int, engine: Any, cause: Exception, left: float, deadline: float) -> bool:
        swapped = False
        try:
            with self._lock:
                self._refuse_if_closing(index, cause)
                self._starting[index] = engine
            ray.get(engine.health.remote(), timeout=min(self.start_timeout_s, left))  # placed and started
            loaded = None
            while True:
                with self._slots_changed:
                    self._refuse_if_closing(index, cause)
                    if self._weights is None or self._weights is loaded:
                        self.engines[index] = engine
                        self._replacing.discard(index)  # in the same step: a push from now on reaches it
                        self._starting.pop(index, None)
                        self._slots_changed.notify_all()
                        swapped = True
                        return True
                    loaded = self._weights
                ray.get(engine.update_weights.remote(*loaded), timeout=max(0.0, deadline - time.monotonic()))
        finally:
            if not swapped:
                ray.kill(engine)

    def _retire(self, index: int, cause: Exception) -> bool:
        """Take slot ``index`` out of service (under the pool's lock); the last serving slot is the run's error."""
        self._refuse_if_closing(index, cause)
        why = (f"the rollout.max_engine_restarts={self.max_restarts} restarts are used up"
               if self.restarts >= self.max_restarts else
               f"no replacement came up within {self.replacement_timeout_s:g} s")
        self.engines[index] = None
        self.retired.append(index)
        if not self.num_alive():
            first_line = str(cause).splitlines()[0] if str(cause) else ""
            raise EngineRestartsExhausted(
                f"the last serving rollout engine ({index}) failed ({type(cause).__name__}: {first_line}) and "
                f"{why}") from cause
        log.warning("rollout engine %d failed (%s) and %s: retired, %d engines serve on", index,
                    type(cause).__name__, why, self.num_alive())
        return False
