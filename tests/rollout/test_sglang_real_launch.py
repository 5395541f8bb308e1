"""Launch mode against real SGLang servers on CPU: started by rlfw's engine in Ray actors, killed, restarted.

Each test starts servers of its own (a start costs 15-45 s), so these are few: a server SIGKILLed mid-generation,
one that is not healthy in time, one that exits at start. The port check and the attach-mode paths share one server
in ``test_sglang_real_server.py``; the only stand-in is SGLang's CPU kernel package.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests

from rlfw.rollout.engines.sglang import SGLangEngine
from test_sglang_engine import EOS, PROMPTS, SHAPE, STATE_A, STATE_B, assert_same, free_ports, reference, wait_for
from test_sglang_real_server import LONG, real_launch_cfg, slowed_down

pytestmark = pytest.mark.e2e


def processes_in(group: int) -> list[int]:
    """The live processes of a server's process group (it leads a session of its own: its pid is the group)."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def test_killed_server_batch_is_resent_and_server_restarted_with_current_weights(shared_ray, tmp_path):
    """SIGKILL of a real server while it generates (as the OOM killer would): its engine leaves, the pool starts a
    new engine whose fresh server starts from the current weights (v2, not the v1 it first started from), and the
    batch is sent again there; nothing of the killed server is left."""
    import ray

    from rlfw.rollout.engines.pool import EnginePool

    cfg = real_launch_cfg(free_ports(1))
    workdir = tmp_path / "rollout" / "engine_0"

    def start_engine(index: int, incarnation: int):
        # Two calls at a time, as build_engine starts an engine that supports partial rollouts.
        return ray.remote(SGLangEngine).options(num_cpus=0, max_concurrency=2).remote(
            cfg, SHAPE, EOS, seed=index + 10 * incarnation, index=index, host="127.0.0.1", workdir=workdir)

    pool = EnginePool(start_engine, num_engines=1, max_inflight=0, max_restarts=1)
    groups = []
    try:
        pool.update_weights(STATE_A, version=1)  # the server starts from v1
        pool.update_weights(STATE_B, version=2)
        [first] = pool.health(timeout_s=60)
        groups.append(first["server_pid"])
        temporary = Path(psutil.Process(first["server_pid"]).environ()["TMPDIR"])  # its own, removed with it
        assert any(temporary.iterdir())
        with slowed_down(first["url"], workdir / "sglang_server.log") as running, ThreadPoolExecutor(1) as thread:
            rollout = thread.submit(pool.generate, PROMPTS, LONG)
            running()
            os.kill(first["server_pid"], signal.SIGKILL)
            generations = rollout.result(timeout=600)
        assert pool.restarts == 1  # the call met the death, and its batch went to the replacement
        assert_same(generations, reference(STATE_B, PROMPTS, LONG), version=2, atol=1e-4)

        [second] = pool.health(timeout_s=300)
        groups.append(second["server_pid"])
        assert second["server_pid"] != first["server_pid"] and second["weight_version"] == 2
        info = requests.get(second["url"] + "/model_info", timeout=10).json()
        assert info["weight_version"] == "2" and info["model_path"] == str(workdir / "v2")
    finally:
        pool.shutdown()
    for group in groups:  # SGLang's scheduler and detokenizer included
        wait_for(lambda group=group: not processes_in(group), f"server process group {group} to end")
    assert not temporary.exists()
    # stopped by rlfw, not crashed: SGLang's crash diagnostics (5 s of sleep in every stop) stay off
    assert "before crash diagnostics" not in (workdir / "sglang_server.log").read_text()


def test_server_not_healthy_in_time_fails_naming_it_and_is_stopped(shared_ray, tmp_path):
    """A real server slower to start than rollout.sglang.startup_timeout_s (a loaded machine takes minutes)."""
    port = free_ports(1)
    engine = SGLangEngine(real_launch_cfg(port, startup_timeout_s=3.0), SHAPE, EOS, 0, 0, "127.0.0.1",
                          tmp_path / "engine_0")
    with pytest.raises(RuntimeError) as error:
        engine.update_weights(STATE_A, version=1)
    message = str(error.value)
    assert f"SGLang engine 0 at http://127.0.0.1:{port} did not become healthy within " \
           "rollout.sglang.startup_timeout_s=3.0s" in message
    # The last health check's answer and the tail of its log, which begins with the command line it was started with.
    assert "(last check: " in message and str(tmp_path / "engine_0" / "sglang_server.log") in message
    assert "SGLang engine 0: " in message and "sglang.launch_server" in message
    assert engine.weight_version is None
    wait_for(lambda: not processes_in(engine.server_pid), "the server's processes to end")


def test_server_that_exits_at_start_fails_with_its_log(shared_ray, tmp_path):
    """The default command (this interpreter), where SGLang is not installed: rollout=sglang without its environment.
    (Any exit at start takes this path; a bad flag in extra_args would too, after 10 s of SGLang's imports.)"""
    engine = SGLangEngine(real_launch_cfg(free_ports(1), launch_command=["{python}", "-m", "sglang.launch_server"]),
                          SHAPE, EOS, 0, 0, "127.0.0.1", tmp_path / "engine_0")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 while waiting to start: see its log; its "
                                           r"command line .* is rollout\.sglang\.launch_command .*rollout\.sglang\."
                                           r"extra_args; last lines of .*sglang_server\.log.*No module named 'sglang'"):
        engine.update_weights(STATE_A, version=1)
    assert engine.weight_version is None
