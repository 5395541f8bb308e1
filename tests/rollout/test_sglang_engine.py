"""The SGLang engine against a stand-in server, for what a real one cannot be made to do on demand (see below).

``test_sglang_real_server.py`` runs the engine against a real SGLang server; here a stand-in holds requests between
two decode steps (a push lands mid-generation at a chosen token), acts as a router, and fails at launch on cue.

What runs for real here: rlfw's client, engine and launcher code; HTTP over loopback; server processes started by
Ray actors with rlfw's command line and killed with real signals; HF checkpoints written to disk and loaded by the
servers; generation, tokens and log-probs computed by ``LocalEngine`` inside the stand-in
(``fake_sglang_server.py``), which speaks SGLang 0.5.23's request and response JSON for ``/generate``,
``/update_weights_from_disk``, ``/pause_generation`` (mode abort), ``/continue_generation``, ``/health_generate``
and ``/model_info``, refuses fields SGLang would not know, stops a generation between two decode steps when paused,
and can act as a router.

What is NOT exercised against a real SGLang: SGLang's own sampling kernels and log-prob numerics (which follow
SGLang's documented semantics: ``softmax(logits / temperature)`` before top-p, as ``LocalEngine``), its
``sampling_seed`` determinism (needs ``--enable-deterministic-inference``), its start-up on GPUs (CUDA graphs,
memory fraction, tensor parallelism across Ray-assigned GPUs), the real ``sglang.launch_server`` flag parser, the
real SGLang router, how long a real server takes to start or reload weights, and how long its pause takes (SGLang
polls its requests once a second while it aborts them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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
from rlfw.rollout.engines.sglang_server import launch_argv, server_gpus
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


def assert_same(generations, expected, version):
    assert [g.response_ids for g in generations] == [e.response_ids for e in expected]
    assert [g.finish_reason for g in generations] == [e.finish_reason for e in expected]
    for g, e in zip(generations, expected):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), rtol=0, atol=1e-5)
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


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


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


def test_a_colocated_servers_share_must_leave_the_trainers_their_training_phase():
    from rlfw.config.devices import GIB, check_gpu_memory

    qwen2_0p5b = ModelShape(num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
                            ffn_hidden_size=4864, vocab_size=151936, max_seq_len=160, qkv_bias=True,
                            tie_word_embeddings=True)
    two_cells = ["dp.num_cells=2", "cluster.gpus_per_worker=0.5", "cluster.placement=colocated"]

    def check(fraction: float):
        cfg = compose(*two_cells, f"rollout.sglang.extra_args=['--mem-fraction-static={fraction}']")
        return check_gpu_memory(cfg, qwen2_0p5b, 80 * GIB, samples_per_engine=512)

    budget = check(0.5)  # the server takes half of the 74.5 GiB the cells' resident 5.5 GiB leave; they train beside
    assert abs(budget.generate / GIB - (5.52 + 37.24)) < 0.01 and abs(budget.train / GIB - (16.56 + 37.24)) < 0.01
    with pytest.raises(ConfigError, match=r"training phase beside its SGLang server, which keeps 67\.0 GiB .*"
                                          r"need 16\.6 GiB.*lower --mem-fraction-static"):
        check(0.9)
    with pytest.raises(ConfigError, match=r"--mem-fraction-static=0\.01 gives the SGLang server 0\.7 GiB of the 74\.5"
                                          r" GiB .* resident 5\.5 GiB: less than its 0\.9 GiB of bf16 weights"):
        check(0.01)


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


def test_weight_update_changes_outputs_and_version(server, tmp_path):
    engine = attached(tmp_path, server["url"])
    engine.update_weights(STATE_A, version=4)
    before = engine.generate(PROMPTS, GREEDY)
    engine.update_weights(STATE_B, version=5)
    after = engine.generate(PROMPTS, GREEDY)

    assert_same(before, reference(STATE_A, PROMPTS, GREEDY), version=4)
    assert_same(after, reference(STATE_B, PROMPTS, GREEDY), version=5)
    assert [g.response_ids for g in before] != [g.response_ids for g in after]
    info = requests.get(server["url"] + "/model_info", timeout=10).json()
    assert info["weight_version"] == "5" and info["model_path"] == str(tmp_path / "engine_0" / "v5")
    assert not (tmp_path / "engine_0" / "v4").exists()  # the previous checkpoint is gone once v5 is loaded


def test_server_with_other_weights_is_reloaded_before_it_answers(server, tmp_path):
    engine = attached(tmp_path, server["url"])
    engine.update_weights(STATE_A, version=6)
    # Behind rlfw's back the server gets other weights (say its supervisor restarted it from an old checkpoint).
    other = save_server_checkpoint(tmp_path / "other", STATE_B, SHAPE, EOS)
    response = requests.post(server["url"] + "/update_weights_from_disk",
                             json={"model_path": str(other), "weight_version": "99"}, timeout=30)
    assert response.json()["success"] is True

    generations = engine.generate(PROMPTS, GREEDY)

    assert_same(generations, reference(STATE_A, PROMPTS, GREEDY), version=6)
    loads = [e["body"]["weight_version"] for e in events(server["events"])
             if e.get("path") == "/update_weights_from_disk"]
    assert loads[-2:] == ["99", "6"]  # the stale answer made the engine reload v6


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


HELD_AT = 4  # tokens a held server's first generation samples before it waits for a pause
LONG = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture
def held_server(tmp_path):
    """A server of its own whose first generation holds after ``HELD_AT`` tokens until a pause stops it."""
    model = save_server_checkpoint(tmp_path / "initial", STATE_A, SHAPE, EOS)
    port = free_ports(1)
    process = start_fake(tmp_path, "held", port, "--model-path", str(model), "--fake-hold-after", str(HELD_AT),
                         "--fake-events", str(tmp_path / "held.jsonl"))
    yield {"url": f"http://127.0.0.1:{port}", "events": tmp_path / "held.jsonl"}
    process.kill()
    process.wait()


def has_held(log: Path) -> bool:
    return any(e["event"] == "held" for e in events(log))


def posts_after_hold(log: Path) -> list[tuple[str, dict]]:
    """The POST requests the server took from the moment its generation held."""
    log_events = events(log)
    held = next(i for i, e in enumerate(log_events) if e["event"] == "held")
    return [(e["path"], e["body"]) for e in log_events[held:] if e.get("method") == "POST"]


def test_weights_pushed_mid_generation_continue_the_requests_under_them(held_server, tmp_path):
    """A partial rollout on SGLang: weights v2 pushed while v1 generates (the server holds the generation after 4
    tokens) make the call pause the server, whose aborted requests answer with their 4 tokens; the server loads v2
    and continues, and every unfinished request goes on from its prompt and those tokens under v2, exactly as v2
    continues them on its own (greedy). Each token records its version."""
    engine = attached(tmp_path, held_server["url"])
    engine.update_weights(STATE_A, version=1)
    with ThreadPoolExecutor(2) as threads:
        call = threads.submit(engine.generate, PROMPTS, LONG)
        wait_for(lambda: has_held(held_server["events"]), "the generation to hold")
        push = threads.submit(engine.update_weights, STATE_B, 2)
        generations = call.result(timeout=300)
        push.result(timeout=300)

    before = reference(STATE_A, PROMPTS, LONG)
    unfinished = [i for i, b in enumerate(before) if len(b.response_ids) > HELD_AT]
    rest = reference(STATE_B, [PROMPTS[i] + before[i].response_ids[:HELD_AT] for i in unfinished],
                     replace(LONG, max_new_tokens=LONG.max_new_tokens - HELD_AT))
    assert unfinished and any(r.response_ids != before[i].response_ids[HELD_AT:] for i, r in zip(unfinished, rest))
    for i, (generation, old) in enumerate(zip(generations, before)):
        assert generation.weight_version == 1
        if i not in unfinished:  # finished under v1 before the push
            assert generation.response_ids == old.response_ids
            assert generation.token_versions == [1] * len(old.response_ids)
            continue
        new = rest[unfinished.index(i)]
        assert generation.response_ids == old.response_ids[:HELD_AT] + new.response_ids
        assert generation.finish_reason == new.finish_reason
        assert generation.token_versions == [1] * HELD_AT + [2] * len(new.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs),
                                   torch.tensor(old.logprobs[:HELD_AT] + new.logprobs), rtol=0, atol=1e-5)
    # The push was taken by the generate call, which paused the server first, and returned once it was loaded.
    posts = posts_after_hold(held_server["events"])
    assert [path for path, _ in posts] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation",
                                           "/generate"]
    assert posts[0][1] == {"mode": "abort"} and posts[1][1]["weight_version"] == "2"
    assert posts[3][1]["input_ids"] == [PROMPTS[i] + before[i].response_ids[:HELD_AT] for i in unfinished]


def test_requests_aborted_by_someone_else_go_on_from_their_tokens(held_server, tmp_path):
    """A pause the engine did not ask for (an operator's) aborts its requests: they keep the tokens they got and are
    sent again from there, under the same weights, once the server continues: the greedy answer is unchanged."""
    engine = attached(tmp_path, held_server["url"])
    engine.update_weights(STATE_A, version=1)
    with ThreadPoolExecutor(1) as thread:
        call = thread.submit(engine.generate, PROMPTS, LONG)
        wait_for(lambda: has_held(held_server["events"]), "the generation to hold")
        requests.post(held_server["url"] + "/pause_generation", json={"mode": "abort"}, timeout=60).raise_for_status()
        requests.post(held_server["url"] + "/continue_generation", json={}, timeout=60).raise_for_status()
        generations = call.result(timeout=300)

    before = reference(STATE_A, PROMPTS, LONG)
    assert_same(generations, before, version=1)
    assert all(g.token_versions == [1] * len(g.response_ids) for g in generations)
    resent = [body for path, body in posts_after_hold(held_server["events"]) if path == "/generate"]
    assert resent[-1]["input_ids"] == [p + b.response_ids[:HELD_AT] for p, b in zip(PROMPTS, before)
                                       if len(b.response_ids) > HELD_AT]


def test_dead_attached_server_gives_a_clear_error(tmp_path):
    model = save_server_checkpoint(tmp_path / "initial", STATE_A, SHAPE, EOS)
    port = free_ports(1)
    process = start_fake(tmp_path, "doomed", port, "--model-path", str(model))
    engine = attached(tmp_path, f"http://127.0.0.1:{port}")
    engine.update_weights(STATE_A, version=1)
    process.kill()
    process.wait()
    with pytest.raises(RuntimeError, match=rf"SGLang engine 0 at http://127.0.0.1:{port} gave up: .*health check"):
        engine.generate(PROMPTS, GREEDY)


# --- launch mode: servers started by Ray actors ----------------------------------------------------------------


@pytest.fixture(scope="session")
def ray_cluster(shared_ray):
    """The session's Ray (tests/conftest.py)."""


def launch_cfg(tmp_path: Path, base_port: int, *extra: str, **overrides) -> SGLangConfig:
    return sglang_cfg(**{"launch_command": ["{python}", FAKE_SERVER], "base_port": base_port, "gpus_per_engine": 0,
                         "extra_args": ["--fake-spawn-child", "--fake-events", str(tmp_path / "events.jsonl"), *extra],
                         **overrides})


@pytest.mark.e2e
def test_server_that_never_becomes_healthy_fails_naming_it(ray_cluster, tmp_path):
    port = free_ports(1)
    engine = SGLangEngine(launch_cfg(tmp_path, port, "--fake-never-healthy", startup_timeout_s=3.0),
                          SHAPE, EOS, 0, 0, "127.0.0.1", tmp_path / "engine_0")
    with pytest.raises(RuntimeError) as error:
        engine.update_weights(STATE_A, version=1)
    message = str(error.value)
    assert f"SGLang engine 0 at http://127.0.0.1:{port} did not become healthy within " \
           "rollout.sglang.startup_timeout_s=3.0s" in message
    # The last health check's answer (refused while it starts, 503 once it listens) and the tail of its log, which
    # begins with the command line it was started with.
    assert "(last check: " in message and str(tmp_path / "engine_0" / "sglang_server.log") in message
    assert "SGLang engine 0: " in message and "--fake-never-healthy" in message
    # Stopped, with the child it may have forked by then.
    children = [e["child_pid"] for e in events(tmp_path / "events.jsonl") if e["event"] == "started"]
    for pid in [engine.server_pid, *children]:
        wait_for(lambda pid=pid: not alive(pid), f"process {pid} to end")


@pytest.mark.e2e
def test_server_that_exits_at_start_fails_with_its_log(ray_cluster, tmp_path):
    engine = SGLangEngine(launch_cfg(tmp_path, free_ports(1), "--no-such-flag"), SHAPE, EOS, 0, 0, "127.0.0.1",
                          tmp_path / "engine_0")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2 while waiting to start.*unrecognized arguments"):
        engine.update_weights(STATE_A, version=1)


def test_gpus_asked_where_there_are_none_fail_at_once_naming_the_key(ray_cluster, tmp_path):
    engine = SGLangEngine(launch_cfg(tmp_path, free_ports(1), gpus_per_engine=1), SHAPE, EOS, 0, 0, "127.0.0.1",
                          tmp_path / "engine_0")
    with pytest.raises(RuntimeError, match=r"rollout.sglang.gpus_per_engine=1 but this node has 0 GPUs"):
        engine.update_weights(STATE_A, version=1)
    assert engine.server_pid is None and engine.weight_version is None


@pytest.mark.e2e
def test_killed_server_batch_is_resent_and_server_restarted_with_current_weights(ray_cluster, tmp_path):
    import ray

    from rlfw.rollout.engines.pool import EnginePool

    base_port = free_ports(2)
    hang = tmp_path / "hang-once"
    cfg = launch_cfg(tmp_path, base_port, "--fake-hang-once", str(hang))

    def start_engine(index: int, incarnation: int):
        # Two calls at a time, as build_engine starts an engine that supports partial rollouts.
        return ray.remote(SGLangEngine).options(num_cpus=0, max_concurrency=2).remote(
            cfg, SHAPE, EOS, seed=index + 10 * incarnation, index=index, host="127.0.0.1",
            workdir=tmp_path / "rollout" / f"engine_{index}")

    pool = EnginePool(start_engine, num_engines=2, max_inflight=0, max_restarts=2)
    try:
        pool.update_weights(STATE_A, version=1)
        pool.update_weights(STATE_B, version=2)
        hang.touch()  # the first /generate to arrive hangs until its server is killed
        with ThreadPoolExecutor(1) as thread:
            running = thread.submit(pool.generate, PROMPTS, GREEDY)
            [hung] = wait_for(lambda: [e for e in events(tmp_path / "events.jsonl") if e["event"] == "hang"],
                              "a server to hang in /generate")
            os.kill(hung["pid"], signal.SIGKILL)
            generations = running.result(timeout=600)

        assert_same(generations, reference(STATE_B, PROMPTS, GREEDY), version=2)
        # The rollout served on with the other server; the health check waits for the replacement under way.
        assert [h["weight_version"] for h in pool.health(timeout_s=300)] == [2, 2]
        log = events(tmp_path / "events.jsonl")
        at_hang = log.index(hung)
        hung_batch = [e for e in log[:at_hang] if e.get("path") == "/generate" and e["port"] == hung["port"]][-1]
        resent = [e for e in log[at_hang:] if e.get("path") == "/generate"
                  and e["body"]["input_ids"] == hung_batch["body"]["input_ids"]]
        assert resent, "the killed server's batch was not sent again"
        # The replacement server started from the current checkpoint (v2) before it served anything.
        [restarted] = [e for e in log[at_hang:] if e["event"] == "started"]
        assert restarted["port"] == hung["port"] and restarted["pid"] != hung["pid"]
        assert restarted["argv"][restarted["argv"].index("--weight-version") + 1] == "2"
        model_path = restarted["argv"][restarted["argv"].index("--model-path") + 1]
        assert model_path == str(tmp_path / "rollout" / f"engine_{hung['port'] - base_port}" / "v2")
        assert pool.restarts == 1
    finally:
        pool.shutdown()
    starts = [e for e in events(tmp_path / "events.jsonl") if e["event"] == "started"]
    assert len(starts) == 3
    for pid in [e["pid"] for e in starts] + [e["child_pid"] for e in starts]:
        wait_for(lambda pid=pid: not alive(pid), f"process {pid} to end")  # no server or child outlives the pool


def test_a_push_the_server_refuses_leaves_the_engine_on_the_weights_it_holds(server, tmp_path):
    """The engine labels every token with its weight version: after a failed push it must still name the weights
    the server holds, not the ones it failed to load."""
    engine = attached(tmp_path, server["url"])
    engine.update_weights(STATE_A, version=7)
    other = save_server_checkpoint(tmp_path / "other", STATE_B, SHAPE, EOS)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4 * SHAPE.max_seq_len}))
    with pytest.raises(RuntimeError, match="could not load"):  # another model: the server refuses it
        engine.update_weights_from_dir(str(other), version=8)
    assert engine.weight_version == 7
    assert_same(engine.generate(PROMPTS, GREEDY), reference(STATE_A, PROMPTS, GREEDY), version=7)


def test_a_launched_servers_url_is_the_resolved_address(tmp_path):
    """``cluster.host=auto`` on a local run: the engine talks to the loopback address its server binds, not to a
    host named "auto"."""
    engine = SGLangEngine(sglang_cfg(), SHAPE, EOS, 0, 0, "auto", tmp_path / "engine_0")
    assert engine.server.url == f"http://127.0.0.1:{sglang_cfg().base_port}"
