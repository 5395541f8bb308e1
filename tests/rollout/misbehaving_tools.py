"""Tools that fail in every way a tool can, for the tool pool's tests; their worker processes import this module."""

import os
import signal
import time
from pathlib import Path

from rlfw.rollout.envs.tools import tool

TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


@tool("echo", "Return the text.", TEXT)
def echo(text: str) -> str:
    return f"{text} (pid {os.getpid()})"


@tool("hang", "Never return.", TEXT)
def hang(text: str) -> str:
    while True:
        time.sleep(1)


@tool("raises", "Raise.", TEXT)
def raises(text: str) -> str:
    raise KeyError(text)


@tool("number", "Return a number, not text.", TEXT)
def number(text: str) -> int:
    return len(text)


@tool("huge", "Return a megabyte of text.", TEXT)
def huge(text: str) -> str:
    return text * 2**20


@tool("hog", "Allocate 4 GiB.", TEXT)
def hog(text: str) -> str:
    return str(len(bytearray(4 * 2**30)))


@tool("dies", "SIGKILL its own worker; with a marker file, only while the file exists (it removes it).", TEXT)
def dies(text: str) -> str:
    marker = Path(text)
    if text == "always" or marker.exists():
        if text != "always":
            marker.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    return f"survived (pid {os.getpid()})"
