"""Math reward: the response's final answer must be mathematically equal to the reference answer (math-verify).

math-verify extracts the final answer (``\\boxed{...}``, "the answer is ...", else the last number or expression)
and compares with SymPy, so ``\\frac{1}{2}``, ``1/2`` and ``0.5`` agree. A response can make SymPy run for ever
(``\\boxed{2^{2^{2^{2^{5}}}}}``), so every score has a deadline. math-verify's own timeouts use ``signal.alarm``,
which works only in a process's main thread, and only between Python bytecodes. The RolloutManager scores in a
thread of its actor (its concurrency groups), so off the main thread the score is computed in a worker process, in
that process' main thread where math-verify's timeouts hold, and a worker that outlives them (a computation inside C
code) is killed and replaced: that response scores 0.0. The worker dies with its parent (``PR_SET_PDEATHSIG``), so
a SIGKILLed actor leaves no scorer running; Linux ties that signal to the *thread* that started the worker, so
workers are started from one thread kept for the process' life, never from the caller's (a request thread).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from concurrent.futures import Future

from math_verify import parse, verify

log = logging.getLogger(__name__)

WORKER_START_S = 120.0  # a new worker's start-up: spawning Python and importing SymPy
WORKER_GRACE_S = 5.0  # past math-verify's own timeouts (two parses and the comparison), before a worker is killed


def _score(response_text: str, answer: str, timeout_s: int) -> float:
    gold = parse(answer, parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"the reference answer {answer!r} holds no math that math-verify can parse")
    predicted = parse(response_text, parsing_timeout=timeout_s)
    return float(verify(gold, predicted, timeout_seconds=timeout_s))


def _ready() -> bool:
    return True  # unpickling this function in the worker imports this module, math-verify and SymPy


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """The worker's initializer: SIGKILL when the thread that started it ends (the process being killed included)."""
    if sys.platform.startswith("linux"):
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


class _Worker:
    """One spawned process that scores in its main thread; replaced when a score outlives its deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = None
        self._requests: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._starter = None

    def _start_pools(self) -> None:
        """The starter thread: a daemon that lives as long as the process, so a worker's death signal fires with the
        process, not with whichever request thread needed a new worker. (An executor's thread would not do: it is
        joined when the main thread finishes, while other threads may still be scoring.)"""
        while True:
            started = self._requests.get()
            try:
                started.set_result(multiprocessing.get_context("spawn").Pool(
                    1, initializer=_die_with_parent, initargs=(os.getpid(),)))
            except BaseException as error:  # noqa: BLE001 - handed to the request that waits for it
                started.set_exception(error)

    def _start(self):
        if self._starter is None:
            self._starter = threading.Thread(target=self._start_pools, name="math-reward-starter", daemon=True)
            self._starter.start()
        started = Future()
        self._requests.put(started)
        try:
            return started.result(timeout=WORKER_START_S)
        except TimeoutError:  # a pool that comes up after all is ended, not left idle
            started.add_done_callback(lambda done: done.exception() is None and done.result().terminate())
            raise

    def score(self, response_text: str, answer: str, timeout_s: int) -> float:
        with self._lock:
            if self._pool is None:
                pool = self._start()
                try:
                    pool.apply_async(_ready).get(timeout=WORKER_START_S)
                except BaseException:
                    pool.terminate()
                    raise
                atexit.register(pool.terminate)  # ended before the interpreter tears down what it needs
                self._pool = pool
            call = self._pool.apply_async(_score, (response_text, answer, timeout_s))
            try:
                return call.get(timeout=3 * timeout_s + WORKER_GRACE_S)
            except multiprocessing.TimeoutError:
                atexit.unregister(self._pool.terminate)
                self._pool.terminate()
                self._pool = None
                log.warning("math_reward: scoring a response of %d characters outlived math-verify's %d s timeouts; "
                            "its worker was killed and the response scores 0.0", len(response_text), timeout_s)
                return 0.0


_WORKER = _Worker()


def math_reward(prompt_text: str, response_text: str, answer: str, *, timeout_s: int = 5) -> float:
    """1.0 if the response's final answer equals ``answer`` (numerically or symbolically), else 0.0.

    A response without a parseable answer scores 0.0, and so does one whose parse or comparison exceeds
    ``timeout_s`` seconds (math-verify logs those). A reference answer without parseable math raises ValueError:
    it is a broken dataset record, not a wrong response.
    """
    if threading.current_thread() is threading.main_thread():
        return _score(response_text, answer, timeout_s)
    return _WORKER.score(response_text, answer, timeout_s)
