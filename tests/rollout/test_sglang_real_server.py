"""The SGLang engine against a real SGLang server on CPU (``make setup-sglang``'s environment, see the README).

One server for this file's tests (a start costs 15-45 s), attached by URL, as a user attaches rlfw to servers they
started; each test pushes its own weights and versions. The only stand-in is SGLang's CPU kernel package
(``tests/sglang_cpu/sgl_kernel``). A test that needs a generation still running when it acts (a push, a pause, a
kill) slows the server down with SGLang's own test hook, ``/slow_down`` (every batch sleeps first), rather than
racing a tiny model. Launch mode against real servers: ``test_sglang_real_launch.py``; what a real server cannot do
here (act as a router, sample as the trainer's model does) stays with ``fake_sglang_server.py`` in
``test_sglang_engine.py``.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import requests
import torch

from rlfw.model.shape import ModelShape
from rlfw.rollout.engines.local import LocalEngine
from rlfw.rollout.engines.sglang import SGLangEngine, save_server_checkpoint
from rlfw.rollout.engines.sglang_client import SGLangClient
from rlfw.rollout.engines.sglang_server import ServerProcess, launch_argv
from rlfw.rollout.types import SamplingParams
from test_sglang_engine import (
    EOS, GREEDY, PROMPTS, SHAPE, STATE_A, STATE_B, assert_same, free_ports, reference, sglang_cfg, wait_for,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
             "--dtype", "float32", "--max-total-tokens", "4096", "--mem-fraction-static", "0.05", "--sleep-on-idle"]


# A real server's start on two cores: 15 s idle, over 2 minutes seen with another test file running beside it.
REAL_START_S = 300.0
LONG = SamplingParams(temperature=0.0, max_new_tokens=12)
SLOW_BATCH_S = 0.3  # how long a slowed-down server sleeps before each batch (prefill or decode step)


def sglang_python() -> str:
    """The SGLang environment's interpreter: a missing one fails the tests (CI builds it), it never skips them."""
    python = os.environ.get("RLFW_SGLANG_PYTHON") or str(REPO / ".sglang" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(f"no SGLang environment at {python}: run `make setup-sglang` (or set RLFW_SGLANG_PYTHON)")
    return python


def launch_command() -> list[str]:
    return ["env", "SGLANG_USE_CPU_ENGINE=1", sglang_python(), "-m", "sglang.launch_server"]


def real_launch_cfg(base_port: int, **overrides):
    """Launch mode: engine i starts a real CPU server on base_port + i, given REAL_START_S to become healthy."""
    return sglang_cfg(**{"launch_command": launch_command(), "base_port": base_port, "gpus_per_engine": 0,
                         "extra_args": CPU_FLAGS, "startup_timeout_s": REAL_START_S, **overrides})


@pytest.fixture(scope="module")  # stopped after this file
def real_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_sglang")
    model = save_server_checkpoint(tmp / "initial", STATE_B, SHAPE, EOS)
    port = free_ports(1)
    argv = launch_argv(launch_command(), str(model), "127.0.0.1", port, 1, "initial", 0, CPU_FLAGS)
    process = ServerProcess("real SGLang server", str(tmp / "server.log"))
    process.start(argv)
    url = f"http://127.0.0.1:{port}"
    client = SGLangClient(url, 60.0, 10.0)
    try:
        wait_for(lambda: process.returncode() is not None or client.health_error() is None, "the SGLang server",
                 deadline_s=600)
        assert process.returncode() is None, process.log_tail(60)
        yield {"url": url, "process": process, "log": tmp / "server.log"}
    finally:
        process.stop()


def attached(tmp_path, url, **overrides) -> SGLangEngine:
    return SGLangEngine(sglang_cfg(urls=[url], **overrides), SHAPE, EOS, 0, 0, "127.0.0.1", tmp_path / "engine_0")


def batches_run(log: Path) -> int:
    """The batches a slowed-down server ran (it logs each one)."""
    return log.read_text(errors="replace").count("Scheduler.run_batch sleep")


@contextmanager
def slowed_down(url: str, log: Path):
    """Every batch of the server sleeps ``SLOW_BATCH_S`` first; yields ``running()``, which waits until a generation
    sent meanwhile has run its prefill and a decode step (its requests hold tokens)."""
    requests.post(url + "/slow_down", json={"forward_sleep_time": SLOW_BATCH_S}, timeout=30).raise_for_status()
    before = batches_run(log)
    try:
        yield lambda: wait_for(lambda: batches_run(log) >= before + 2, "the generation to run")
    finally:
        try:
            requests.post(url + "/slow_down", json={"forward_sleep_time": None}, timeout=30).raise_for_status()
        except requests.ConnectionError:
            pass  # a server killed meanwhile: nothing to undo (its replacement starts at full speed)


def test_greedy_generations_and_logprobs_match_the_trainers(real_server, tmp_path):
    """Tokens, finish reasons and log-probs as the trainer's own model computes them, under the pushed version;
    budgets cut at max_new_tokens and the eos id stops."""
    engine = attached(tmp_path, real_server["url"])
    engine.update_weights(STATE_A, version=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)

    generations = engine.generate(PROMPTS, params)

    expected = reference(STATE_A, PROMPTS, params)
    assert [g.response_ids for g in generations] == [e.response_ids for e in expected]
    assert [g.finish_reason for g in generations] == [e.finish_reason for e in expected]
    assert {"length"} <= {g.finish_reason for g in generations}
    for g, e in zip(generations, expected):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), rtol=0, atol=1e-4)
    assert {g.weight_version for g in generations} == {1}
    # The next push replaces the checkpoint: the server loads it, and the previous one is gone once it has.
    engine.update_weights(STATE_B, version=2)
    assert_same(engine.generate(PROMPTS, GREEDY), reference(STATE_B, PROMPTS, GREEDY), version=2, atol=1e-4)
    info = requests.get(real_server["url"] + "/model_info", timeout=10).json()
    assert info["weight_version"] == "2" and info["model_path"] == str(tmp_path / "engine_0" / "v2")
    assert not (tmp_path / "engine_0" / "v1").exists()


def test_a_stale_server_is_given_the_current_weights_and_the_batch_re_sent(real_server, tmp_path):
    engine = attached(tmp_path, real_server["url"])
    engine.update_weights(STATE_A, version=2)
    before = engine.generate(PROMPTS, GREEDY)
    # Behind rlfw's back the server gets other weights (say its supervisor restarted it from an old checkpoint).
    other = save_server_checkpoint(tmp_path / "other", STATE_B, SHAPE, EOS)
    answer = requests.post(real_server["url"] + "/update_weights_from_disk",
                           json={"model_path": str(other), "weight_version": "99"}, timeout=120)
    assert answer.json()["success"] is True

    after = engine.generate(PROMPTS, GREEDY)

    assert [g.response_ids for g in after] == [g.response_ids for g in before]  # v2's answers, not v99's
    assert [g.response_ids for g in after] == [e.response_ids for e in reference(STATE_A, PROMPTS, GREEDY)]
    info = requests.get(real_server["url"] + "/model_info", timeout=10).json()
    assert info["weight_version"] == "2"


def test_weights_pushed_as_tensors_reach_the_server_without_a_checkpoint(real_server, shared_ray, tmp_path):
    """weight_sync=tensor: the weights go in shared memory (/update_weights_from_tensor), none to disk; a server
    that lost them gets them again the same way. The engine runs in an actor, as in a run: the shared-memory
    manager torch starts for it ends with its process."""
    import ray

    engine = ray.remote(SGLangEngine).remote(sglang_cfg(urls=[real_server["url"]], weight_sync="tensor"), SHAPE, EOS,
                                             0, 0, "127.0.0.1", tmp_path / "engine_0")
    try:
        for version, state in [(7, STATE_A), (8, STATE_B)]:
            ray.get(engine.update_weights.remote(state, version), timeout=120)
            generations = ray.get(engine.generate.remote(PROMPTS, GREEDY), timeout=120)
            assert [g.response_ids for g in generations] == [e.response_ids for e in reference(state, PROMPTS, GREEDY)]
            assert {g.weight_version for g in generations} == {version}
        assert not list(tmp_path.rglob("*.safetensors"))
        # Behind rlfw's back the server gets other weights: the engine pushes v8's tensors again before answering.
        other = save_server_checkpoint(tmp_path / "other", STATE_A, SHAPE, EOS)
        answer = requests.post(real_server["url"] + "/update_weights_from_disk",
                               json={"model_path": str(other), "weight_version": "99"}, timeout=120)
        assert answer.json()["success"] is True
        generations = ray.get(engine.generate.remote(PROMPTS, GREEDY), timeout=120)
        assert [g.response_ids for g in generations] == [e.response_ids for e in reference(STATE_B, PROMPTS, GREEDY)]
        assert requests.get(real_server["url"] + "/model_info", timeout=10).json()["weight_version"] == "8"
    finally:
        ray.kill(engine)


def test_a_bad_weights_path_is_refused_and_the_engine_keeps_its_weights(real_server, tmp_path):
    engine = attached(tmp_path, real_server["url"])
    engine.update_weights(STATE_B, version=3)
    with pytest.raises(RuntimeError, match="could not load"):
        engine.update_weights_from_dir(str(tmp_path / "no_such_checkpoint"), version=4)
    assert engine.weight_version == 3
    generations = engine.generate(PROMPTS, GREEDY)
    assert [g.response_ids for g in generations] == [e.response_ids for e in reference(STATE_B, PROMPTS, GREEDY)]
    assert {g.weight_version for g in generations} == {3}


def test_weights_pushed_mid_generation_continue_the_requests_under_them(real_server, tmp_path):
    """A partial rollout: weights v2 pushed while v1 generates make the call pause the server (its aborted requests
    answer with their tokens so far), which loads v2 and continues; every unfinished request goes on from its prompt
    and those tokens under v2, exactly as v2 continues them (greedy). Each token records the version that sampled it.
    Where the push lands is the server's timing: the test reads it from the token versions."""
    engine = attached(tmp_path, real_server["url"])
    engine.update_weights(STATE_A, version=1)
    with slowed_down(real_server["url"], real_server["log"]) as running, ThreadPoolExecutor(2) as threads:
        call = threads.submit(engine.generate, PROMPTS, LONG)
        running()
        threads.submit(engine.update_weights, STATE_B, 2).result(timeout=300)
        generations = call.result(timeout=300)

    before = reference(STATE_A, PROMPTS, LONG)
    continued = 0
    for prompt, generation, old in zip(PROMPTS, generations, before):
        assert generation.weight_version == 1
        held = generation.token_versions.count(1)
        assert generation.token_versions == [1] * held + [2] * (len(generation.response_ids) - held)
        assert generation.response_ids[:held] == old.response_ids[:held]
        if held == len(generation.response_ids):  # finished under v1 before the push
            assert generation.response_ids == old.response_ids
            continue
        [new] = reference(STATE_B, [prompt + old.response_ids[:held]],
                          replace(LONG, max_new_tokens=LONG.max_new_tokens - held))
        assert generation.response_ids[held:] == new.response_ids
        assert generation.finish_reason == new.finish_reason
        torch.testing.assert_close(torch.tensor(generation.logprobs),
                                   torch.tensor(old.logprobs[:held] + new.logprobs), rtol=0, atol=1e-4)
        continued += held > 0
    assert continued, f"no response went on across the push: {[g.token_versions for g in generations]}"


def test_without_partial_rollouts_a_push_waits_for_the_call_under_way(real_server, tmp_path):
    """rollout.sglang.partial_rollouts=false: weights v2 pushed while v1 generates load once the call has ended, so
    every token of the call is v1's, exactly as v1 generates them (greedy); the push returns after the call, and
    the server then holds v2."""
    engine = attached(tmp_path, real_server["url"], partial_rollouts=False)
    engine.update_weights(STATE_A, version=1)
    with slowed_down(real_server["url"], real_server["log"]) as running, ThreadPoolExecutor(2) as threads:
        call = threads.submit(engine.generate, PROMPTS, LONG)
        running()
        push = threads.submit(engine.update_weights, STATE_B, 2)
        generations = call.result(timeout=300)
        push.result(timeout=300)

    old = reference(STATE_A, PROMPTS, LONG)
    assert [g.response_ids for g in generations] == [o.response_ids for o in old]
    assert all(g.token_versions == [1] * len(g.response_ids) for g in generations)
    assert engine.weight_version == 2
    assert requests.get(real_server["url"] + "/model_info", timeout=10).json()["weight_version"] == "2"


def test_requests_aborted_by_someone_else_go_on_from_their_tokens(real_server, tmp_path):
    """A pause the engine did not ask for (an operator's) aborts its requests: they keep the tokens they got and are
    sent again from there, under the same weights, once the server continues: the greedy answer is unchanged."""
    url = real_server["url"]
    engine = attached(tmp_path, url)
    engine.update_weights(STATE_A, version=3)
    with slowed_down(url, real_server["log"]) as running, ThreadPoolExecutor(1) as thread:
        call = thread.submit(engine.generate, PROMPTS, LONG)
        running()
        requests.post(url + "/pause_generation", json={"mode": "abort"}, timeout=60).raise_for_status()
        requests.post(url + "/continue_generation", json={}, timeout=60).raise_for_status()
        generations = call.result(timeout=300)

    assert_same(generations, reference(STATE_A, PROMPTS, LONG), version=3, atol=1e-4)
    assert all(g.token_versions == [3] * len(g.response_ids) for g in generations)


def test_a_hung_server_is_a_clear_error_and_serves_again_once_it_runs(real_server, tmp_path):
    """A server stopped (SIGSTOP) past its deadlines: the engine gives up, naming the server and what timed out,
    instead of waiting on it; once the server runs again, the engine the pool starts in its place (attach mode: on
    the same server) serves from it. The replacement has the default deadlines: the resumed server first finishes
    the requests it held, which on a loaded machine takes longer than the 2 s that detect the hang."""
    url = real_server["url"]
    engine = attached(tmp_path, url, request_timeout_s=2.0, control_timeout_s=1.0)
    engine.update_weights(STATE_A, version=4)
    group = real_server["process"].pid()
    os.killpg(group, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match=rf"SGLang engine 0 at {url} gave up: {url} failed its health check: "
                                               rf".*\(during /generate: {url}: /generate did not answer within 2.0s\)"):
            engine.generate(PROMPTS, GREEDY)
    finally:
        os.killpg(group, signal.SIGCONT)
    replacement = attached(tmp_path, url)
    replacement.update_weights(STATE_A, version=4)
    assert_same(replacement.generate(PROMPTS, GREEDY), reference(STATE_A, PROMPTS, GREEDY), version=4, atol=1e-4)


def test_a_port_in_use_is_refused_before_a_server_starts(real_server, shared_ray, tmp_path):
    """rollout.sglang.base_port where another server listens: the engine must not take that server for its own
    (nor push its weights to it); it says so, naming the key, before it starts anything."""
    url = real_server["url"]
    port = int(url.rsplit(":", 1)[1])
    held = requests.get(url + "/model_info", timeout=10).json()["weight_version"]
    engine = SGLangEngine(real_launch_cfg(port, control_timeout_s=2.0), SHAPE, EOS, 0, 0, "127.0.0.1",
                          tmp_path / "engine_0")
    try:
        with pytest.raises(RuntimeError, match=rf"cannot start its server on 127.0.0.1:{port}: the port is in use "
                                               rf".*rollout\.sglang\.base_port={port}"):
            engine.update_weights(STATE_A, version=5)
        assert engine.server_pid is None and engine.weight_version is None
    finally:
        engine.shutdown()
    assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == held


def test_a_server_of_another_architecture_is_refused_before_the_first_push(real_server, tmp_path):
    """SGLang dies of a checkpoint of another shape loaded into its running model: attached to a server started
    from another model, the engine says so, naming what differs, and pushes nothing; the server serves on."""
    url = real_server["url"]
    served = save_server_checkpoint(tmp_path / "served", STATE_A, SHAPE, EOS)
    answer = requests.post(url + "/update_weights_from_disk",
                           json={"model_path": str(served), "weight_version": "21"}, timeout=120)
    assert answer.json()["success"] is True
    policy = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                        vocab_size=16, max_seq_len=64)
    engine = SGLangEngine(sglang_cfg(urls=[url]), policy, EOS, 0, 0, "127.0.0.1", tmp_path / "engine_0")
    with pytest.raises(RuntimeError, match=rf"serves {served}, which is not of the policy's architecture "
                                           r"\(hidden_size 64 \(policy: 32\), ffn_hidden_size 128 \(policy: 64\)"):
        engine.update_weights(LocalEngine(policy, EOS, 0, seed=0).model.state_dict(), version=22)
    assert engine.weight_version is None
    assert requests.get(url + "/model_info", timeout=10).json()["weight_version"] == "21"
    assert attached(tmp_path, url).server.health_error() is None


def test_a_dead_attached_server_is_a_clear_error(real_server, tmp_path):
    """Last in this file: it kills the file's server (its whole process group, as a lost node would)."""
    url = real_server["url"]
    engine = attached(tmp_path, url)
    engine.update_weights(STATE_A, version=6)
    os.killpg(real_server["process"].pid(), signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"SGLang engine 0 at {url} gave up: {url} failed its health check: "
                                           r"ConnectionError"):
        engine.generate(PROMPTS, GREEDY)
