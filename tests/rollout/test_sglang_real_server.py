"""The SGLang engine against a real SGLang server on CPU (``make setup-sglang``'s environment, see the README).

One server for this file's tests (a start costs 15-45 s), attached by URL, as a user attaches rlfw to servers they
started; each test pushes its own weights and versions. The only stand-in is SGLang's CPU kernel package
(``tests/sglang_cpu/sgl_kernel``). What a real server cannot be made to do on demand (hold a request between two
decode steps, act as a router) stays with ``fake_sglang_server.py`` in ``test_sglang_engine.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import requests
import torch

from rlfw.rollout.engines.sglang import SGLangEngine, save_server_checkpoint
from rlfw.rollout.engines.sglang_client import SGLangClient
from rlfw.rollout.engines.sglang_server import ServerProcess, launch_argv
from rlfw.rollout.types import SamplingParams
from test_sglang_engine import (
    EOS, GREEDY, PROMPTS, SHAPE, STATE_A, STATE_B, free_ports, reference, sglang_cfg, wait_for,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
             "--dtype", "float32", "--max-total-tokens", "4096", "--mem-fraction-static", "0.05"]


def sglang_python() -> str:
    """The SGLang environment's interpreter: a missing one fails the tests (CI builds it), it never skips them."""
    python = os.environ.get("RLFW_SGLANG_PYTHON") or str(REPO / ".sglang" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(f"no SGLang environment at {python}: run `make setup-sglang` (or set RLFW_SGLANG_PYTHON)")
    return python


@pytest.fixture(scope="module")  # stopped after this file: an idle SGLang scheduler busy-polls a core
def real_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_sglang")
    model = save_server_checkpoint(tmp / "initial", STATE_B, SHAPE, EOS)
    port = free_ports(1)
    argv = launch_argv(["env", "SGLANG_USE_CPU_ENGINE=1", sglang_python(), "-m", "sglang.launch_server"],
                       str(model), "127.0.0.1", port, 1, "initial", 0, CPU_FLAGS)
    process = ServerProcess("real SGLang server", str(tmp / "server.log"))
    process.start(argv)
    url = f"http://127.0.0.1:{port}"
    client = SGLangClient(url, 60.0, 10.0)
    try:
        wait_for(lambda: process.returncode() is not None or client.health_error() is None, "the SGLang server",
                 deadline_s=600)
        assert process.returncode() is None, process.log_tail(60)
        yield {"url": url, "process": process}
    finally:
        process.stop()


def attached(tmp_path, url, **overrides) -> SGLangEngine:
    return SGLangEngine(sglang_cfg(urls=[url], **overrides), SHAPE, EOS, 0, 0, "127.0.0.1", tmp_path / "engine_0")


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
