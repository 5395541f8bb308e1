"""The built-in tools: integer arithmetic for the calc task, and Python code for chat-template tasks (GSM8K).

Tool workers import this module, so it imports nothing heavy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from rlfw.rollout.envs.tools import tool

_EXPRESSION = re.compile(r"\s*(\d+)\s*([-+*])\s*(\d+)\s*")
MAX_OPERAND_DIGITS = 12


@tool("calc", "Evaluate a + b, a - b or a * b of two non-negative integers.",
      {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
def calc(expression: str) -> str:
    """The value of ``expression``: two integers (digits may be spaced, as the calc task writes them) and one of
    ``+ - *``; anything else raises (an error observation)."""
    match = _EXPRESSION.fullmatch(re.sub(r"(?<=\d) (?=\d)", "", expression))
    if match is None:
        raise ValueError(f"not an expression of two integers: {expression!r}")
    a, op, b = match.groups()
    if max(len(a), len(b)) > MAX_OPERAND_DIGITS:
        raise ValueError(f"operands have at most {MAX_OPERAND_DIGITS} digits")
    a, b = int(a), int(b)
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


PYTHON_TIMEOUT_S = 5.0
# Run before the program: it dies with the worker (a killed worker leaves no program running), gets a CPU-time
# limit of its own, and is refused sockets from inside the interpreter (the network namespace, where unshare
# works, closes the rest).
_PREAMBLE = (
    "import ctypes, resource, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    f"resource.setrlimit(resource.RLIMIT_CPU, ({int(PYTHON_TIMEOUT_S) + 1}, {int(PYTHON_TIMEOUT_S) + 1}))\n"
    "def _audit(event, args):\n"
    "    if event.startswith(('socket.', 'urllib.')):\n"
    "        raise PermissionError('no network in the python tool')\n"
    "sys.addaudithook(_audit)\n"
    "del _audit, ctypes, resource, signal, sys\n"
)


@tool("python", "Run a Python program and return what it prints (no network, 5 seconds).",
      {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})
def python(code: str) -> str:
    """Run ``code`` in a fresh, isolated interpreter (``-I``) with no network (its own empty network namespace
    where ``unshare`` allows one, and an audit hook refusing sockets) and a time limit; its stdout, or its error."""
    command = [sys.executable, "-I", "-c", _PREAMBLE + code]
    if _unshare_works():
        command = ["unshare", "--net", "--map-root-user", *command] if os.geteuid() else ["unshare", "--net",
                                                                                           *command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PYTHON_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, env={"PATH": os.environ.get("PATH", "")})
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the program ran past {PYTHON_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                           f"exit status {done.returncode}")
    return done.stdout


_UNSHARE: list[bool] = []


def _unshare_works() -> bool:
    if not _UNSHARE:
        unshare = shutil.which("unshare")
        flags = ["--net"] if os.geteuid() == 0 else ["--net", "--map-root-user"]
        _UNSHARE.append(unshare is not None and subprocess.run(
            [unshare, *flags, "true"], capture_output=True, timeout=10).returncode == 0)
    return _UNSHARE[0]
