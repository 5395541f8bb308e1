"""ToolPool: tool calls run in worker processes, outside the rollout manager's, each with a deadline.

A call goes to a free worker (``tool_worker``). A worker that does not answer within ``timeout_s`` is killed and
replaced, and the call is an error observation (a hang is not retried: it would hang again). A worker that dies
during a call (killed, out of memory in native code) is replaced and the call retried once; a second death is an
error observation. Each worker's address space is capped at ``memory_mb``. Nothing a tool does ends the step.

Workers are started from one thread kept for the process' life: Linux ties a child's death signal to the thread
that started it, and the workers must die with the manager, not with whichever episode thread needed one.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from rlfw.rollout.envs.tools import ToolSpec

START_TIMEOUT_S = 60.0  # a new worker's interpreter start and imports


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer (``output``) or why there is none (``error``), and the seconds the call took."""

    output: str | None
    error: str | None
    seconds: float


class _WorkerGone(Exception):
    """The worker's process ended (or closed its pipe) during a call."""


class _Worker:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._buffer = b""

    def read_line(self, deadline: float) -> dict:
        """The next JSON line from the worker; TimeoutError past ``deadline``, _WorkerGone when it died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _WorkerGone
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class ToolPool:
    """``workers`` worker processes (started on first use); ``timeout_s`` per call; ``memory_mb`` per worker
    (0: no cap); outputs longer than ``max_output_chars`` are cut there, and the observation says so."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0, memory_mb: int = 1024,
                 max_output_chars: int = 2000) -> None:
        if workers < 1 or timeout_s <= 0 or memory_mb < 0 or max_output_chars < 1:
            raise ValueError(f"tool pool: workers={workers} and max_output_chars={max_output_chars} must be >= 1, "
                             f"timeout_s={timeout_s} > 0 and memory_mb={memory_mb} >= 0")
        self.workers, self.timeout_s = workers, timeout_s
        self.memory_mb, self.max_output_chars = memory_mb, max_output_chars
        self._free: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._free.put(None)  # a slot whose worker starts when first needed
        self._starts: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._starter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self.replaced = 0  # workers killed (hung) or found dead, and replaced

    def call(self, spec: ToolSpec, arguments: dict) -> ToolResult:
        """Run ``spec``'s function on ``arguments`` in a worker; never raises for what the tool does."""
        t0 = time.monotonic()
        malformed = spec.check(arguments)
        if malformed is not None:
            return ToolResult(None, f"malformed call of {spec.name}: {malformed}", 0.0)
        request = json.dumps({"path": spec.path, "arguments": arguments}) + "\n"
        try:
            worker = self._free.get(timeout=self.workers * (self.timeout_s + START_TIMEOUT_S))
        except queue.Empty:
            return ToolResult(None, f"{spec.name}: no tool worker became free", time.monotonic() - t0)
        try:
            for attempt in range(2):
                if worker is None:
                    try:
                        worker = self._start()
                    except (RuntimeError, TimeoutError) as e:
                        return ToolResult(None, f"{spec.name}: {e}", time.monotonic() - t0)
                try:
                    answer = self._ask(worker, request)
                except TimeoutError:
                    self._discard(worker)
                    worker = None
                    return ToolResult(None, f"{spec.name} timed out after {self.timeout_s:g} s",
                                      time.monotonic() - t0)
                except _WorkerGone:
                    self._discard(worker)
                    worker = None
                    if attempt == 0:
                        continue  # retried once, on a fresh worker
                    return ToolResult(None, f"{spec.name}: its worker process died twice on this call",
                                      time.monotonic() - t0)
                return self._result(spec, answer, time.monotonic() - t0)
            raise AssertionError("unreachable")
        finally:
            self._free.put(worker)

    def _result(self, spec: ToolSpec, answer: dict, seconds: float) -> ToolResult:
        if "error" in answer:
            return ToolResult(None, f"{spec.name} failed: {answer['error']}", seconds)
        output = answer["output"]
        if "truncated" in answer:
            output += f"\n[output truncated: {answer['truncated']} characters, the limit is {self.max_output_chars}]"
        return ToolResult(output, None, seconds)

    def _ask(self, worker: _Worker, request: str) -> dict:
        try:
            worker.proc.stdin.write(request.encode())
            worker.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise _WorkerGone from None
        return worker.read_line(time.monotonic() + self.timeout_s)

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self.replaced += 1

    def _start(self) -> _Worker:
        with self._lock:
            if self._starter is None:
                self._starter = threading.Thread(target=self._start_workers, name="tool-worker-starter", daemon=True)
                self._starter.start()
        started: Future = Future()
        self._starts.put(started)
        try:
            worker = started.result(timeout=START_TIMEOUT_S)
        except TimeoutError:  # a worker that comes up after all is ended, not left idle
            started.add_done_callback(lambda done: done.exception() is None and done.result().kill())
            raise RuntimeError(f"no tool worker started within {START_TIMEOUT_S:g} s") from None
        try:
            worker.read_line(time.monotonic() + START_TIMEOUT_S)  # {"ready": true}
        except (TimeoutError, _WorkerGone):
            worker.kill()
            raise RuntimeError("a tool worker did not start; see its stderr in the rollout manager's log") from None
        with self._lock:
            self._all.add(worker)
        return worker

    def _start_workers(self) -> None:
        command = [sys.executable, "-m", "rlfw.rollout.envs.tool_worker", str(os.getpid()), str(self.memory_mb),
                   str(self.max_output_chars)]
        while True:
            started = self._starts.get()
            try:
                started.set_result(_Worker(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)))
            except BaseException as error:  # noqa: BLE001 - handed to the call that waits for it
                started.set_exception(error)

    def close(self) -> None:
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()
