"""The SGLang engine's wire format, config and launch flags, and against a stand-in server what a real one cannot do.

The engine's paths run against real SGLang servers on CPU in ``test_sglang_real_server.py`` (attach mode: generation
and log-probs, weight pushes by disk and by tensor, stale servers, partial rollouts across a push, pauses, a hung
server, a dead one, a port in use) and ``test_sglang_real_launch.py`` (launch mode: a killed server restarted with the
current weights, a slow start, an exit at start). Here a stand-in server (``fake_sglang_server.py``: rlfw's
``LocalEngine`` behind SGLang 0.5.23's JSON) serves what a real one cannot here: an SGLang router (a Rust package
of its own, not installed), and seeded sampling at temperature 1 with top-p whose every token the test predicts
(a real server samples with its own kernels: only its greedy tokens and log-probs can match the trainer's).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import requests
import torch

from rlfw.config import ConfigError, register_configs, validate
from rlfw.config.schema import SGLangConfig
from rlfw.model.shape import ModelShape
from rlfw.rollout.engines.local import LocalEngine
from rlfw.rollout.engines.sglang import SGLangEngine, save_server_checkpoint
from rlfw.rollout.engines.sglang_client import (
    Output,
    ServerError,
    generate_payload,
    parse_outputs,
    request_seeds,
)
from rlfw.rollout.engines.sglang_server import ServerProcess, launch_argv, server_gpus
from rlfw.rollout.types import Generation, SamplingParams

torch.set_num_threads(1)
register_configs()

FAKE_SERVER = str(Path(__file__).with_name("fake_sglang_server.py"))
SHAPE = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, vocab_size=16,
    max_seq_len=64,
)  # fmt: skip
EOS = 2
PROMPTS = [[1, 5, 6, 7, 3], [1, 9, 3], [1, 4, 4, 4, 4, 4, 4, 3], [1, 8, 3]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def random_state(seed: int) -> dict[str, torch.Tensor]:
    """HF-named weights, larger than HF's init so that logits are far from uniform."""
    names = LocalEngine(SHAPE, EOS, 0, seed=0).model.state_dict()
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator) * 0.5 for k, v in names.items()}


STATE_A, STATE_B = random_state(1), random_state(2)


def reference(state, prompts, params) -> list[Generation]:
    """What LocalEngine generates with these weights; with a seed, request by request as the servers do."""
    engine = LocalEngine(SHAPE, EOS, 0, seed=0)
    engine.update_weights(state, version=0)
    if params.seed is None:
        return engine.generate(prompts, params)
    seeds = request_seeds(params.seed, len(prompts))
    return [engine.generate([p], replace(params, seed=s))[0] for p, s in zip(prompts, seeds)]


def assert_same(generations, expected, version, atol=1e-5):
    assert [g.response_ids for g in generations] == [e.response_ids for e in expected]
    assert [g.finish_reason for g in generations] == [e.finish_reason for e in expected]
    for g, e in zip(generations, expected):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), rtol=0, atol=atol)
    assert {g.weight_version for g in generations} == {version}


def free_ports(count: int) -> int:
    """A base port with ``count`` free ports after it (loopback; probed, so a test-only helper)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count < 65536 and all(_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, what: str, deadline_s: float = 120.0):
    """Poll until ``predicate()`` is truthy (readiness of real processes, not a timing assertion)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def sglang_cfg(**overrides) -> SGLangConfig:
    fast = {"startup_timeout_s": 120.0, "request_timeout_s": 60.0, "weight_update_timeout_s": 60.0,
            "control_timeout_s": 10.0, "max_retries": 2, "retry_backoff_s": 0.05}
    return SGLangConfig(**{**fast, **overrides})


def start_fake(tmp_path: Path, name: str, port: int, *args: str) -> subprocess.Popen:
    with open(tmp_path / f"{name}.log", "ab") as log:  # the child keeps its own handle
        process = subprocess.Popen(
            [sys.executable, FAKE_SERVER, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", *args],
            stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: process.poll() is not None or _healthy(url), f"{name} to start")
    assert process.poll() is None, (tmp_path / f"{name}.log").read_text()
    return process


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/health_generate", timeout=5).status_code == 200
    except requests.RequestException:
        return False


# --- the wire format ---------------------------------------------------------------------------------------------


def test_payload_uses_sglang_field_names():
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5)
    payload = generate_payload([[1, 2], [1, 2]], params, [EOS], seeds=None)
    assert payload == {
        "input_ids": [[1, 2], [1, 2]],
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5, "stop_token_ids": [EOS]},
        "return_logprob": True,
    }
    seeded = generate_payload([[1, 2], [1, 2]], params, [EOS], seeds=request_seeds(11, 2))
    first, second = seeded["sampling_params"]
    # The samples of one group share a prompt but not a seed, else a deterministic server repeats one sample.
    assert first["sampling_seed"] != second["sampling_seed"]
    assert request_seeds(11, 2) == request_seeds(11, 2)
    # Continuations: each request asks for the tokens its sample has left.
    continued = generate_payload([[1, 2, 7], [1, 2]], params, [EOS], seeds=None, max_new_tokens=[4, 5])
    assert [sp["max_new_tokens"] for sp in continued["sampling_params"]] == [4, 5]


# One answer of SGLang 0.5.23's /generate for a batch of two (meta_info abridged to what rlfw reads and a few more).
SGLANG_ANSWER = [
    {"output_ids": [5, 2], "meta_info": {
        "id": "a1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "weight_version": "7",
        "completion_tokens": 2, "cached_tokens": 0, "output_token_logprobs": [[-0.5, 5, None], [-1.25, 2, None]]}},
    {"output_ids": [9], "meta_info": {
        "id": "a2", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 4, "weight_version": "7",
        "completion_tokens": 1, "cached_tokens": 0, "output_token_logprobs": [[-2.0, 9, None]]}},
]  # fmt: skip


def test_parse_sglang_answer():
    assert parse_outputs("http://s", SGLANG_ANSWER, 2, "7") == [
        Output([5, 2], [-0.5, -1.25], "stop"),
        Output([9], [-2.0], "length"),
    ]


def test_parse_keeps_what_aborted_requests_sampled():
    """A paused server answers its aborted requests with the tokens so far (FINISH_ABORT().to_json()), and those it
    aborted before their prefill with none (older SGLang versions send no log-prob list there)."""
    answer = json.loads(json.dumps(SGLANG_ANSWER))
    answer[0]["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted", "status_code": None,
                                               "err_type": None}
    answer[1] = {"meta_info": {"id": "a2", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                               "prompt_tokens": 0, "completion_tokens": 0}}
    assert parse_outputs("http://s", answer, 2, "7") == [
        Output([5, 2], [-0.5, -1.25], "abort", "Aborted"),
        Output([], [], "abort", "Abort before prefill"),
    ]


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda a: a[0]["meta_info"].update(weight_version="6"), "weight version '6', expected '7'"),
        (lambda a: a[1]["meta_info"].update(finish_reason={"type": "oom"}), "unexpected finish_reason"),
        (lambda a: a.pop(), "answered 1 items for 2 prompts"),
        (lambda a: a[0]["meta_info"].pop("output_token_logprobs"), "lacks"),
        (lambda a: a[1]["meta_info"].update(output_token_logprobs=[]), "without generated tokens"),
    ],
)
def test_parse_refuses_stale_or_garbled_answers(mutate, expected):
    answer = json.loads(json.dumps(SGLANG_ANSWER))
    mutate(answer)
    with pytest.raises(ServerError, match=expected):
        parse_outputs("http://s", answer, 2, "7")


def test_launch_command_line():
    argv = launch_argv(["{python}", "-m", "sglang.launch_server"], "/ckpt/v3", "127.0.0.1", 30001, 2, "3", 9,
                       ["--mem-fraction-static", "0.7"])
    assert argv == [sys.executable, "-m", "sglang.launch_server", "--model-path", "/ckpt/v3", "--host", "127.0.0.1",
                    "--port", "30001", "--tp-size", "2", "--weight-version", "3", "--random-seed", "9",
                    "--skip-tokenizer-init", "--mem-fraction-static", "0.7"]


def test_a_stopped_server_is_stopped_with_sigterm_not_left_to_the_kill(tmp_path):
    """A server frozen by SIGSTOP (a hung one, say) gets its SIGTERM once stop() continues it: it shuts down on its
    own terms instead of sitting out the grace period and being SIGKILLed."""
    ready, said = tmp_path / "ready", tmp_path / "sigterm"
    program = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: "
               f"(pathlib.Path({str(said)!r}).write_text('bye'), sys.exit(0))); "
               f"pathlib.Path({str(ready)!r}).touch(); time.sleep(600)")
    process = ServerProcess("server", str(tmp_path / "server.log"))
    pid = process.start([sys.executable, "-c", program])
    wait_for(ready.exists, "the server to start")
    os.kill(pid, signal.SIGSTOP)
    process.stop(grace_s=30)
    assert said.read_text() == "bye"


# --- config --------------------------------------------------------------------------------------------------------


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=["rollout=sglang", *overrides])


def test_sglang_config_is_accepted():
    validate(compose())
    validate(compose("rollout.sglang.urls=[http://127.0.0.1:30000,http://127.0.0.1:30001]", "rollout.num_engines=2",
                     "rollout.sglang.router_url=http://127.0.0.1:29000"))


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["rollout.sglang.urls=[127.0.0.1:30000]"], "rollout.sglang.urls"),
        (["rollout.sglang.urls=[http://127.0.0.1:1,http://127.0.0.1:2]"], "rollout.num_engines"),
        (["rollout.sglang.router_url=http://127.0.0.1:29000"], "rollout.sglang.router_url"),
        (["rollout.sglang.weight_sync=distributed"], "rollout.sglang.weight_sync"),
        (["rollout.sglang.weight_sync=auto"], "rollout.sglang.weight_sync"),
        (["rollout.sglang.base_port=65535", "rollout.num_engines=2"], "rollout.sglang.base_port"),
        (["rollout.sglang.startup_timeout_s=0"], "rollout.sglang.startup_timeout_s"),
        (["rollout.sglang.max_retries=-1"], "rollout.sglang.max_retries"),
        (["rollout.sglang.launch_command=[]"], "rollout.sglang.launch_command"),
    ],
)
def test_bad_sglang_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose(*overrides))


def test_a_colocated_server_shares_the_trainers_gpus():
    cfg = compose("cluster.placement=colocated", "rollout.num_engines=2",
                  "rollout.sglang.extra_args=[--mem-fraction-static,0.5]")
    tokenizer = type("Tokenizer", (), {"eos_token_id": EOS})()
    assert SGLangEngine.init_kwargs(cfg, SHAPE, tokenizer, 0, 1, Path("w"))["colocated"]
    assert not SGLangEngine.init_kwargs(compose(), SHAPE, tokenizer, 0, 1, Path("w"))["colocated"]
    # Ray gave the trainers the GPUs: the server's actor asks for none, and the engines spread over the node's GPUs
    assert server_gpus(1, colocated=True, index=1, node_gpus=1) == (0, ["--base-gpu-id", "0"])
    assert server_gpus(1, colocated=True, index=1, node_gpus=2) == (0, ["--base-gpu-id", "1"])
    assert server_gpus(2, colocated=False, index=1, node_gpus=4) == (2, [])  # Ray's CUDA_VISIBLE_DEVICES places it
    assert server_gpus(0, colocated=True, index=1, node_gpus=0) == (0, [])  # a CPU build


@pytest.mark.parametrize("fraction", [None, "1.5", "x"])
def test_a_colocated_server_needs_a_bound_on_its_memory(fraction):
    extra = f"[--mem-fraction-static,{fraction}]" if fraction else "[]"
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.extra_args gives --mem-fraction-static .*colocated"):
        validate(compose("cluster.placement=colocated", f"rollout.sglang.extra_args={extra}"))


def test_tensor_push_is_not_implemented(tmp_path):
    with pytest.raises(NotImplementedError, match="weight_sync='distributed'"):
        SGLangEngine(sglang_cfg(weight_sync="distributed"), SHAPE, EOS, 0, 0, "127.0.0.1", tmp_path)


# --- attach mode: a running server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A stand-in server started by hand from a checkpoint, as a user starts SGLang before attaching rlfw."""
    tmp = tmp_path_factory.mktemp("server")
    model = save_server_checkpoint(tmp / "initial", STATE_B, SHAPE, EOS)
    port = free_ports(1)
    process = start_fake(tmp, "server", port, "--model-path", str(model), "--weight-version", "initial",
                         "--fake-events", str(tmp / "events.jsonl"))
    yield {"url": f"http://127.0.0.1:{port}", "events": tmp / "events.jsonl", "process": process}
    process.kill()
    process.wait()


def attached(tmp_path, url, **overrides) -> SGLangEngine:
    return SGLangEngine(sglang_cfg(urls=[url], **overrides), SHAPE, EOS, 0, 0, "127.0.0.1", tmp_path / "engine_0")


def test_generations_match_local_engine(server, tmp_path):
    engine = attached(tmp_path, server["url"])
    engine.update_weights(STATE_A, version=1)
    prompts = [p for p in PROMPTS for _ in range(2)]  # two samples per prompt
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=7)

    generations = engine.generate(prompts, params)

    assert_same(generations, reference(STATE_A, prompts, params), version=1)
    body = [e["body"] for e in events(server["events"]) if e.get("path") == "/generate"][-1]
    assert set(body) == {"input_ids", "sampling_params", "return_logprob"}
    assert body["input_ids"] == prompts and body["return_logprob"] is True
    assert [sp["stop_token_ids"] for sp in body["sampling_params"]] == [[EOS]] * len(prompts)


def test_the_health_asked_before_every_rollout_does_not_make_the_server_generate(server, tmp_path):
    # SGLang's /health_generate generates a token and answers a second later at the earliest: asked before every
    # rollout, it delayed each rollout's first request by that second (with loop=async, until after the push).
    engine = attached(tmp_path, server["url"])
    engine.update_weights(STATE_A, version=3)
    before = len(events(server["events"]))
    answer = engine.health()
    assert answer["weight_version"] == 3 and answer["url"] == server["url"]
    assert [e for e in events(server["events"])[before:] if e.get("path") in ("/health", "/health_generate")] == []


def test_generation_through_a_router(server, tmp_path):
    port = free_ports(1)
    router = start_fake(tmp_path, "router", port, "--fake-router-for", server["url"],
                        "--fake-events", str(tmp_path / "router.jsonl"))
    try:
        engine = attached(tmp_path, server["url"], router_url=f"http://127.0.0.1:{port}")
        engine.update_weights(STATE_B, version=8)
        generations = engine.generate(PROMPTS, GREEDY)
    finally:
        router.kill()
        router.wait()
    assert_same(generations, reference(STATE_B, PROMPTS, GREEDY), version=8)
    assert [e["path"] for e in events(tmp_path / "router.jsonl") if e.get("method") == "POST"] == ["/generate"]


def test_gpus_asked_where_there_are_none_fail_at_once_naming_the_key(shared_ray, tmp_path):
    engine = SGLangEngine(sglang_cfg(gpus_per_engine=1), SHAPE, EOS, 0, 0, "127.0.0.1", tmp_path / "engine_0")
    with pytest.raises(RuntimeError, match=r"rollout.sglang.gpus_per_engine=1 but this node has 0 GPUs"):
        engine.update_weights(STATE_A, version=1)
    assert engine.server_pid is None and engine.weight_version is None


def test_a_launched_servers_url_is_the_resolved_address(tmp_path):
    """``cluster.host=auto`` on a local run: the engine talks to the loopback address its server binds, not to a
    host named "auto"."""
    engine = SGLangEngine(sglang_cfg(), SHAPE, EOS, 0, 0, "auto", tmp_path / "engine_0")
    assert engine.server.url == f"http://127.0.0.1:{sglang_cfg().base_port}"
