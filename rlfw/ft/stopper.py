"""``python -m rlfw.ft.stopper DURATION PID...``: stall processes from outside, as a frozen machine would.

SIGSTOP every pid, wait DURATION seconds, SIGCONT every pid that still exists. A pid that is gone meanwhile (its
cell was failed and killed during the stall) is skipped; its start time is checked first, so a reused pid is never
signalled.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil


def stall(duration_s: float, pids) -> None:
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))  # remembers the start time: is_running() rejects a reused pid
        except psutil.NoSuchProcess:
            continue
    for proc in processes:
        _signal(proc, signal.SIGSTOP)
    time.sleep(duration_s)
    for proc in processes:
        _signal(proc, signal.SIGCONT)


def _signal(proc: "psutil.Process", sig: int) -> None:
    if proc.is_running():
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    stall(float(sys.argv[1]), [int(p) for p in sys.argv[2:]])
