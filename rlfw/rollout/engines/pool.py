"""EnginePool: the engine actors of a run, the requests spread over them, and their replacement when one dies.

Requests go out in chunks: every engine holds at most one call of at most ``max_inflight`` requests, and gets the
next chunk when it answers, so a fast engine takes more of the work and no engine queues more than the limit
(memory, latency of a weight update). When an engine's actor dies (its process was killed, ran out of memory,
crashed in native code), the pool starts a new one in its slot, loads the current weights into it *before* it
serves, and sends the dead engine's chunk out again; after ``max_restarts`` restarts over the pool's life it gives
up with ``EngineRestartsExhausted``. A retried chunk is the same requests with the same seed, so a death does not
change what a seeded step samples. Every response must carry the weight version the caller expects: one from
other weights raises ``StaleWeightsError`` rather than reach the trainer.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from rlfw.rollout.types import Generation, SamplingParams


class EngineRestartsExhausted(RuntimeError):
    """An engine died and the pool may not restart another one."""


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
        self, start_engine: Callable[[int, int], Any], num_engines: int, max_inflight: int, max_restarts: int
    ) -> None:
        self._start_engine = start_engine
        self.max_inflight = max_inflight
        self.max_restarts = max_restarts
        self.incarnations = [0] * num_engines
        self.engines = [start_engine(i, 0) for i in range(num_engines)]
        self.restarts = 0
        # The weights every engine must hold: (object ref, version); None before the first update.
        self._weights: tuple[ray.ObjectRef, int] | None = None

    @property
    def weight_version(self) -> int | None:
        return None if self._weights is None else self._weights[1]

    def update_weights(self, hf_state, version: int) -> None:
        """Load ``hf_state`` (a dict or its object ref) into every engine; a dead engine is replaced and loaded."""
        ref = hf_state if isinstance(hf_state, ray.ObjectRef) else ray.put(hf_state)
        self._weights = (ref, version)
        calls = [engine.update_weights.remote(ref, version) for engine in self.engines]
        for index, call in enumerate(calls):
            try:
                ray.get(call)
            except RayActorError as e:
                self._restart(index, e)

    def health(self, timeout_s: float) -> list[dict[str, Any]]:
        """Each engine's health answer; an engine that is dead or does not answer in ``timeout_s`` is replaced."""
        calls = [engine.health.remote() for engine in self.engines]
        answers = []
        for index, call in enumerate(calls):
            try:
                answers.append(ray.get(call, timeout=timeout_s))
            except (RayActorError, GetTimeoutError) as e:
                self._restart(index, e)
                answers.append(ray.get(self.engines[index].health.remote(), timeout=timeout_s))
        return answers

    def generate(self, requests: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One response per request, in order, all from the weights of the last ``update_weights``."""
        if self._weights is None:
            raise RuntimeError("EnginePool.generate called before update_weights: the engines hold no policy")
        chunk_size = self.max_inflight or max(1, math.ceil(len(requests) / len(self.engines)))
        pending = deque(range(len(requests)))
        results: list[Generation | None] = [None] * len(requests)
        inflight: dict[ray.ObjectRef, tuple[int, list[int]]] = {}
        idle = deque(range(len(self.engines)))
        while pending or inflight:
            while idle and pending:
                index = idle.popleft()
                chunk = [pending.popleft() for _ in range(min(chunk_size, len(pending)))]
                call = self.engines[index].generate.remote([requests[i] for i in chunk], chunk_params(params, chunk))
                inflight[call] = (index, chunk)
            [done], _ = ray.wait(list(inflight), num_returns=1)
            index, chunk = inflight.pop(done)
            idle.append(index)
            try:
                generations = ray.get(done)
            except RayActorError as e:
                pending.extendleft(reversed(chunk))  # first in line again, on whichever engine is free next
                self._restart(index, e)
                continue
            for i, generation in zip(chunk, generations):
                self._check_version(index, generation)
                results[i] = generation
        return results  # type: ignore[return-value]  (every slot is filled once the queue is empty)

    def shutdown(self) -> None:
        """Let every live engine release what it started, then end the actors."""
        calls = [engine.shutdown.remote() for engine in self.engines]
        for engine, call in zip(self.engines, calls):
            try:
                ray.get(call)
            except RayActorError:
                pass  # already dead: nothing left to release
            ray.kill(engine)

    def _check_version(self, index: int, generation: Generation) -> None:
        expected = self.weight_version
        if generation.weight_version != expected:
            raise StaleWeightsError(
                f"engine {index} answered with weights v{generation.weight_version}, expected v{expected}"
            )

    def _restart(self, index: int, cause: Exception) -> None:
        """Replace engine ``index`` and load the current weights into it before it serves anything."""
        while True:
            if self.restarts >= self.max_restarts:
                raise EngineRestartsExhausted(
                    f"rollout engine {index} failed ({type(cause).__name__}: {cause}) and the "
                    f"rollout.max_engine_restarts={self.max_restarts} restarts are used up"
                ) from cause
            ray.kill(self.engines[index])  # a hung engine must not come back as a twin
            self.restarts += 1
            self.incarnations[index] += 1
            self.engines[index] = self._start_engine(index, self.incarnations[index])
            if self._weights is None:
                return
            try:
                ray.get(self.engines[index].update_weights.remote(*self._weights))
                return
            except RayActorError as e:
                cause = e
