"""Set-up of every process of an rlfw run before any of its code runs: Ray's ``worker_process_setup_hook`` for the
workers, and the driver's own call.

Megatron-core on a CPU machine without Apex or Transformer Engine warns at import that it falls back to its own
implementations, once per module and process: dozens of identical lines per run that say nothing is wrong. Those
known, harmless warnings go to one file (``RLFW_KNOWN_WARNINGS_LOG``) instead of the console; the driver prints
one line naming it. Every other warning is shown as usual.

A Ray worker also dies with its raylet: Ray's own check lets a worker whose raylet was SIGKILLed live on (an hour
and more was seen after a test session), holding its memory and its children. Standard library only: every worker
imports this.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import warnings

KNOWN_WARNINGS_ENV = "RLFW_KNOWN_WARNINGS_LOG"
KNOWN_HARMLESS = re.compile(
    r"Apex is not installed|Transformer Engine and Apex are not installed|full scope is deprecated"
    r"|tp_group is None, using default tp group|MLP requires ffn_hidden_size"
    r"|The given buffer is not writable"  # torchft's heal transport wraps a received read-only buffer
)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it in ``parent_pid`` ends (the parent's death included);
    exits at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def setup_process() -> None:
    """A Ray worker (whose parent is its raylet) dies with the raylet. Route the known harmless warnings of this
    process to the file that RLFW_KNOWN_WARNINGS_LOG names when they are raised (a driver that runs several jobs
    writes each job's to its own file); without it, show them."""
    raylet = os.environ.get("RAY_RAYLET_PID", "")
    if raylet.isdigit() and os.getppid() in (int(raylet), 1):  # 1: the raylet is already gone
        die_with_parent(int(raylet))
    if getattr(warnings.showwarning, "rlfw_known_warnings", False):
        return
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        path = os.environ.get(KNOWN_WARNINGS_ENV)
        if not path or not KNOWN_HARMLESS.search(str(message)):
            return shown(message, category, filename, lineno, file, line)
        with open(path, "a") as log:
            log.write(f"[pid {os.getpid()}] {warnings.formatwarning(message, category, filename, lineno, line)}")
        return None

    showwarning.rlfw_known_warnings = True
    warnings.showwarning = showwarning
