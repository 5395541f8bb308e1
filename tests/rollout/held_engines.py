"""Test hooks on real engines: a vLLM engine whose generate call can be held before one of its engine steps, so a
weight push lands at a known point of the generation. Only the hold is added; the engine is vLLM's, unchanged."""

import threading

from rlfw.rollout.engines.vllm import VLLMEngine


class HeldVLLMEngine(VLLMEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hold_at = None
        self._steps = 0
        self._reached, self._release = threading.Event(), threading.Event()

    def hold_at(self, step: int) -> None:
        """Hold the next generate call before its ``step``-th engine step (1-based) until ``release``."""
        self._hold_at, self._steps = step, 0
        self._reached.clear()
        self._release.clear()

    def wait_reached(self, timeout_s: float) -> bool:
        return self._reached.wait(timeout_s)

    def push_pending(self) -> bool:
        return self._handoff._pending is not None

    def release(self) -> None:
        self._release.set()

    def _step(self):
        self._steps += 1
        if self._steps == self._hold_at:
            self._reached.set()
            assert self._release.wait(120)
        return super()._step()
