"""ToolEnvironment: the part every environment with tools shares, its tools and the worker pool that runs them.

The pool starts with the first call, in the rollout manager (the driver builds the environment too, for its
tokenizer, and starts nothing). Every call is recorded in its episode (``Episode.tools``), errors included, for the
step's metrics; a call of a tool the environment does not have is recorded under ``unknown``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rlfw.rollout.envs.base import Environment
from rlfw.rollout.envs.episode import Episode, ToolRecord
from rlfw.rollout.envs.tool_pool import ToolPool, ToolResult
from rlfw.rollout.envs.tools import ToolCall, load_tool


class ToolEnvironment(Environment):
    """``tools``: import paths of ``@tool`` functions (none: the environment runs without tools); ``tool_pool``:
    the ``ToolPool`` arguments (``rollout.tools``); ``max_turns``: policy turns per episode."""

    def __init__(self, tools: Sequence[str], tool_pool: Mapping[str, Any], max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"task.max_turns={max_turns} must be >= 1")
        self.tools = {spec.name: spec for spec in (load_tool(path) for path in tools)}
        self.max_turns = max_turns
        self._pool_args = dict(tool_pool)
        self.concurrency = int(self._pool_args.get("workers", 1))  # episodes answered at once (runner)
        self._pool: ToolPool | None = None
        self._lock = threading.Lock()

    def call_tool(self, episode: Episode, call: ToolCall) -> ToolResult:
        """Run ``call`` (or say why it cannot run) and record it in ``episode``."""
        spec = self.tools.get(call.name)
        if call.error is not None or spec is None:
            error = call.error or f"there is no tool {call.name!r}; the tools are: {', '.join(self.tools) or 'none'}"
            result = ToolResult(None, error, 0.0)
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ToolPool(**self._pool_args)
            result = self._pool.call(spec, call.arguments)
        episode.tools.append(ToolRecord(spec.name if spec is not None else "unknown", result.seconds, result.error))
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
