"""Set-up of every process of an rlfw run before any of its code runs: Ray's ``worker_process_setup_hook`` for the
workers, and the driver's own call.

Megatron-core on a CPU machine without Apex or Transformer Engine warns at import that it falls back to its own
implementations, once per module and process: dozens of identical lines per run that say nothing is wrong. Those
known, harmless warnings go to one file (``RLFW_KNOWN_WARNINGS_LOG``) instead of the console; the driver prints
one line naming it. Every other warning is shown as usual. Standard library only: every worker imports this.
"""

from __future__ import annotations

import os
import re
import warnings

KNOWN_WARNINGS_ENV = "RLFW_KNOWN_WARNINGS_LOG"
KNOWN_HARMLESS = re.compile(
    r"Apex is not installed|Transformer Engine and Apex are not installed|full scope is deprecated"
    r"|tp_group is None, using default tp group|MLP requires ffn_hidden_size"
    r"|The given buffer is not writable"  # torchft's heal transport wraps a received read-only buffer
)


def setup_process() -> None:
    """Route the known harmless warnings of this process to the file that RLFW_KNOWN_WARNINGS_LOG names when they
    are raised (a driver that runs several jobs writes each job's to its own file); without it, show them."""
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
