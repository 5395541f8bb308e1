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
import logging
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future

from math_verify import parse, verify

from rlfw.cluster.worker_setup import die_with_parent

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


def _serve(conn, parent_pid: int) -> None:
    """The worker's main loop: one ``(function, args)`` at a time from the pipe, its result or error back."""
    die_with_parent(parent_pid)
    while True:
        try:
            function, args = conn.recv()
        except EOFError:  # the parent closed its end or died
            return
        try:
            reply = (True, function(*args))
        except Exception as error:  # noqa: BLE001 - handed to the caller, as a call in its own process would raise
            reply = (False, error)
        try:
            conn.send(reply)
        except Exception as error:  # noqa: BLE001 - an error that does not pickle goes back as its text
            conn.send((False, RuntimeError(repr(error))))


class _Worker:
    """One spawned process that scores in its main thread; killed and replaced when a score outlives its deadline.

    A plain process and a pipe, not a ``multiprocessing.Pool``: a Pool's ``terminate`` waits for a lock its idle
    worker holds, and at interpreter exit (the Pool's handler threads gone) it waited for ever, so an actor that
    had scored off its main thread never exited, and outlived its Ray cluster. A SIGKILL takes no lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self._requests: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._starter = None

    def _start_processes(self) -> None:
        """The starter thread: a daemon that lives as long as the process, so a worker's death signal fires with the
        process, not with whichever request thread needed a new worker. (An executor's thread would not do: it is
        joined when the main thread finishes, while other threads may still be scoring.)"""
        context = multiprocessing.get_context("spawn")
        while True:
            started = self._requests.get()
            try:
                conn, child_conn = context.Pipe()
                process = context.Process(target=_serve, args=(child_conn, os.getpid()), name="math-reward",
                                          daemon=True)
                process.start()
                child_conn.close()
                started.set_result((process, conn))
            except BaseException as error:  # noqa: BLE001 - handed to the request that waits for it
                started.set_exception(error)

    def _start(self) -> None:
        if self._starter is None:
            self._starter = threading.Thread(target=self._start_processes, name="math-reward-starter", daemon=True)
            self._starter.start()
        started = Future()
        self._requests.put(started)
        try:
            self._process, self._conn = started.result(timeout=WORKER_START_S)
        except TimeoutError:  # a worker that comes up after all is ended, not left idle
            started.add_done_callback(lambda done: done.exception() is None and done.result()[0].kill())
            raise
        atexit.register(self._stop)  # a worker never outlives the interpreter's exit, whatever the exit waits for

    def _call(self, function, args, timeout_s: float):
        self._conn.send((function, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def _stop(self) -> None:
        """SIGKILL the worker and reap it."""
        atexit.unregister(self._stop)
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=WORKER_GRACE_S)
            self._conn.close()
        self._process = self._conn = None

    def score(self, response_text: str, answer: str, timeout_s: int) -> float:
        with self._lock:
            if self._process is None:
                self._start()
                try:
                    self._call(_ready, (), WORKER_START_S)
                except BaseException:
                    self._stop()
                    raise
            try:
                return self._call(_score, (response_text, answer, timeout_s), 3 * timeout_s + WORKER_GRACE_S)
            except TimeoutError:
                self._stop()
                log.warning("math_reward: scoring a response of %d characters outlived math-verify's %d s timeouts; "
                            "its worker was killed and the response scores 0.0", len(response_text), timeout_s)
                return 0.0
            except (EOFError, OSError):  # the worker died (killed from outside): the next score starts another
                self._stop()
                raise


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
