"""A tool worker's process: runs tool calls one at a time, read as JSON lines on stdin, answered on stdout.

It arms ``PR_SET_PDEATHSIG`` so it dies with the thread that started it (``tool_pool`` starts workers from one
thread kept for the process' life), and caps its own address space (``RLIMIT_AS``), which children inherit: a tool
that allocates past it gets a MemoryError, an error observation. The protocol's stdout is kept apart: whatever a
tool prints goes to stderr.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

from rlfw.rollout.envs.tools import import_tool

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def answer(request: dict, max_chars: int) -> dict:
    try:
        output = import_tool(request["path"])(**request["arguments"])
    except BaseException as e:  # noqa: BLE001 - every failure of a tool is the policy's observation
        return {"error": f"{type(e).__name__}: {e}"[:max_chars]}
    if not isinstance(output, str):
        return {"error": f"the tool returned {type(output).__name__}, not text"}
    if len(output) > max_chars:
        return {"output": output[:max_chars], "truncated": len(output)}
    return {"output": output}


def main() -> None:
    parent, memory_mb, max_chars = (int(a) for a in sys.argv[1:4])
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    if memory_mb > 0:
        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a tool's prints (and its children's) go to stderr
    sys.stdout = sys.stderr
    protocol.write('{"ready": true}\n')
    for line in sys.stdin:
        protocol.write(json.dumps(answer(json.loads(line), max_chars)) + "\n")


if __name__ == "__main__":
    main()
