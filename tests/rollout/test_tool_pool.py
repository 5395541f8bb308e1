"""Tool calls in worker processes: every way a tool fails is an error observation, a hung or dead worker is
replaced (a death retried once), outputs are capped, the schema is checked before anything runs."""

import os
from pathlib import Path

import pytest

from rlfw.rollout.envs.tool_pool import ToolPool
from rlfw.rollout.envs.tools import ToolCall, load_tool, parse_compact, parse_tool_calls

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def pool():
    # The workers import the tools of this folder by module name, as a run's workers import a user's tools.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), saved or ""])
    pool = ToolPool(workers=2, timeout_s=3.0, memory_mb=512, max_output_chars=100)
    yield pool
    pool.close()
    if saved is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = saved


def spec(name):
    return load_tool(f"misbehaving_tools.{name}")


def test_answers_and_every_failure_is_an_observation(pool):
    ok = pool.call(spec("echo"), {"text": "hi"})
    assert ok.error is None and ok.output.startswith("hi (pid ")
    assert int(ok.output.split("pid ")[1].rstrip(")")) != os.getpid()  # outside this process
    assert pool.call(spec("raises"), {"text": "k"}).error == "raises failed: KeyError: 'k'"
    assert pool.call(spec("number"), {"text": "abc"}).error == "number failed: the tool returned int, not text"
    huge = pool.call(spec("huge"), {"text": "ab"})
    assert huge.output == "ab" * 50 + "\n[output truncated: 2097152 characters, the limit is 100]"
    assert "MemoryError" in pool.call(spec("hog"), {"text": ""}).error  # past the worker's memory cap
    malformed = [({}, "missing argument(s) text"), ({"text": 1}, "argument 'text' must be a string, got int"),
                 ({"text": "a", "x": 1}, "unknown argument 'x'; echo takes text"), ([1], "must be a JSON object")]
    replaced = pool.replaced
    for arguments, why in malformed:
        assert why in pool.call(spec("echo"), arguments).error
    assert pool.replaced == replaced  # nothing ran


def test_a_hung_call_is_cut_and_its_worker_replaced(pool):
    replaced = pool.replaced
    hung = pool.call(spec("hang"), {"text": ""})
    assert hung.error == "hang timed out after 3 s" and 3.0 <= hung.seconds < 10
    assert pool.replaced == replaced + 1
    assert pool.call(spec("echo"), {"text": "after"}).output.startswith("after")


def test_a_dead_worker_is_replaced_and_the_call_retried_once(pool, tmp_path):
    marker = tmp_path / "die_once"
    marker.touch()
    replaced = pool.replaced
    survived = pool.call(spec("dies"), {"text": str(marker)})  # SIGKILLed once, retried on a fresh worker
    assert survived.error is None and survived.output.startswith("survived")
    assert pool.call(spec("dies"), {"text": "always"}).error == "dies: its worker process died twice on this call"
    assert pool.replaced == replaced + 3


def test_python_tool_runs_code_without_network(pool):
    python = load_tool("rlfw.rollout.envs.builtin_tools.python")
    assert pool.call(python, {"code": "print(6 * 7)"}).output == "42\n"
    refused = pool.call(python, {"code": "import socket; socket.create_connection(('127.0.0.1', 9))"})
    assert "no network" in refused.error or "unreachable" in refused.error
    assert "ZeroDivisionError" in pool.call(python, {"code": "1 / 0"}).error


def test_parsers():
    calls = parse_tool_calls('a<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
                             '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>'
                             '<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>')
    assert calls[:2] == [ToolCall("python", {"code": "print(1)"}), ToolCall("x", {"a": 1})]
    assert calls[2].error.startswith("the call is not valid JSON") and calls[3].error.startswith("a call must be")
    assert parse_tool_calls("the answer is 4") == []
    calc = load_tool("rlfw.rollout.envs.builtin_tools.calc")
    assert parse_compact(["calc", "4", "7", "+", "1"], {"calc": calc}) == ToolCall("calc", {"expression": "4 7 + 1"})
    assert parse_compact(["4", "7"], {"calc": calc}) is None
    with pytest.raises(ValueError, match="is not a tool"):
        load_tool("os.path.join")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_tool("no_such_module.tool")
