"""Tools: Python callables registered by name with a schema, and the parsers that find a call in a policy's turn.

A tool is a function decorated with ``@tool(...)``: its name, a one-line description and a JSON-schema
``parameters`` object (what a chat template shows the model, and what every call is checked against before it
runs). An environment names its tools by import path (``rlfw.rollout.envs.builtin_tools.calc``), so the worker
processes that run them (``tool_pool``) import them by the same path. A tool returns text; anything else, or an
exception, becomes an error observation.

Two call syntaxes: the chat-template one (Qwen2.5 and its kin: ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``), for Hugging Face tokenizers, and a compact one for the built-in word-level tasks: the turn's
first word is the tool's name and the rest of the turn its one argument.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON-schema object: {"type": "object", "properties": {...}, "required": [...]}
    path: str  # module:function, how a worker process imports it

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render (``tools=[...]``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def check(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not fit the schema (None when they do): a malformed call the policy sees."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        properties = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        for key, value in arguments.items():
            if key not in properties:
                return f"unknown argument {key!r}; {self.name} takes {', '.join(properties) or 'none'}"
            wanted = _JSON_TYPES.get(properties[key].get("type"), object)
            if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
                return f"argument {key!r} must be a {properties[key].get('type')}, got {type(value).__name__}"
        return None


def tool(name: str, description: str, parameters: dict[str, Any]) -> Callable[[Callable], Callable]:
    """Register a function as a tool: ``fn.tool_spec`` holds its name and schema."""

    def register(fn: Callable) -> Callable:
        fn.tool_spec = ToolSpec(name, description, parameters, f"{fn.__module__}:{fn.__qualname__}")
        return fn

    return register


def load_tool(path: str, key: str = "task.tools") -> ToolSpec:
    """The spec of the tool at ``module.function`` (or ``module:function``); a clear error naming ``key`` when it
    is not importable or not a registered tool."""
    module, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{key}: tool {path!r} cannot be imported: {e}") from None
    spec = getattr(fn, "tool_spec", None)
    if not isinstance(spec, ToolSpec):
        raise ValueError(f"{key}: {path!r} is not a tool; decorate it with rlfw.rollout.envs.tools.tool(...)")
    return spec


def import_tool(path: str) -> Callable:
    """The function behind a spec's ``path`` (in a worker process)."""
    module, _, name = path.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


@dataclass(frozen=True)
class ToolCall:
    """A call parsed from a turn. ``error``: why it is malformed (the policy sees it; nothing runs)."""

    name: str
    arguments: Any = None
    error: str | None = None


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Qwen2.5-style calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, in order; a call
    whose JSON is broken or lacks a name is returned with its error. No call: an empty list (a final answer)."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("?", error=f"the call is not valid JSON: {e}"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall("?", error='a call must be a JSON object with a "name" and "arguments"'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some templates write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                calls.append(ToolCall(call["name"], error=f"the arguments are not valid JSON: {e}"))
                continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def parse_compact(words: list[str], tools: dict[str, ToolSpec]) -> ToolCall | None:
    """The compact syntax: ``NAME ARGUMENT...``, the turn's first word a tool's name and the other words, joined
    by spaces, its first (and only required) parameter. None when the first word names no tool (a final answer)."""
    if not words or words[0] not in tools:
        return None
    spec = tools[words[0]]
    required = spec.parameters.get("required", [])
    if len(required) != 1:
        return ToolCall(spec.name, error=f"{spec.name} takes {len(required)} arguments; the compact syntax gives one")
    return ToolCall(spec.name, {required[0]: " ".join(words[1:])})
