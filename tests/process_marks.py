"""The processes that carry a mark in their environment (a test session's, a run's), and whether they end."""

from __future__ import annotations

import os
import time
from typing import List

import psutil


# multiprocessing's helpers of this process (its resource tracker, its forkserver, spawned workers such as the math
# reward's scorer): they end with it (their pipe closes, or their death signal fires), not before.
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.spawn", "multiprocessing.forkserver")


def marked_processes(key: str, value: str) -> List[psutil.Process]:
    """Every live process but this one and its multiprocessing helpers whose environment has ``key=value``
    (inherited from whoever set it)."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.ppid() == os.getpid() and any(h in " ".join(process.cmdline()) for h in OWN_HELPERS):
                continue
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get(key) == value:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def leftover_processes(key: str, value: str, grace_s: float) -> List[psutil.Process]:
    """The marked processes still running ``grace_s`` seconds from now (or none, as soon as none is)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = marked_processes(key, value)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
