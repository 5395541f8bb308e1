"""VLLMEngine in its Ray actor (vLLM on CPU, fp32): log-probs and greedy answers against the local engine, weight
reloads and their version labels, loopback-only listeners, and a shutdown that leaves no process behind."""

import psutil
import pytest
import ray
import torch
from engine_helpers import compose_cfg, random_hf_state, shape_of

from rlfw.model.hf_checkpoint import save_hf_checkpoint
from rlfw.rollout.engines import LocalEngine
from rlfw.rollout.tasks import CopyTask
from rlfw.rollout.types import SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = [[1, 5, 6, 7, 3], [1, 5, 6, 7, 3], [1, 9, 3], [1, 4, 4, 4, 4, 4, 4, 3]]
# Measured: vLLM's CPU kernels and HF's eager attention agree to ~1e-5 on this model (fp32).
ATOL = 1e-4


@pytest.fixture(scope="module")
def engines(ray_local, tmp_path_factory):
    """One vLLM engine for the module (its start is most of these tests' time): ``HeldVLLMEngine``, whose generate
    call can be held before a chosen engine step and is VLLMEngine's otherwise, in an actor that takes the hold's
    calls beside a generate call and a push. (``rollout=vllm`` runs build theirs with ``build_engine``:
    tests/e2e/test_vllm.py.) The last test shuts it down."""
    from held_engines import HeldVLLMEngine

    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_cfg(run_dir, "rollout=vllm")
    shape, tokenizer = shape_of(cfg), CopyTask().tokenizer
    kwargs = HeldVLLMEngine.init_kwargs(cfg, shape, tokenizer, seed=0, index=0, workdir=run_dir / "engine")
    vllm = ray.remote(HeldVLLMEngine).options(num_cpus=cfg.rollout.cpus_per_engine, max_concurrency=4).remote(**kwargs)
    local = LocalEngine(shape, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
    ray_listeners = listeners(psutil.Process(ray.get(vllm.health.remote())["pid"]))  # the Ray worker's own
    yield vllm, local, shape, tokenizer, ray_listeners
    ray.kill(vllm)


def listeners(process: psutil.Process) -> set:
    return {(c.laddr.ip, c.laddr.port) for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN}


def recomputed_logprobs(local: LocalEngine, prompt, response, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = local.model(input_ids=torch.tensor([prompt + response])).logits[0]
    scaled = logits[len(prompt) - 1 : -1] / (temperature or 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_logprobs_greedy_answers_and_weight_reloads_match_the_local_engine(engines, tmp_path):
    vllm, local, shape, tokenizer, _ = engines
    for version, seed in [(0, 1), (1, 2)]:  # the start from a checkpoint dir, then an in-place reload
        weights = random_hf_state(shape, seed=seed)
        ray.get(vllm.update_weights.remote(weights, version))
        local.update_weights(weights, version)

        sampled = ray.get(vllm.generate.remote(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=8, seed=3)))
        assert {g.weight_version for g in sampled} == {version}
        assert sampled[0].response_ids != sampled[1].response_ids  # same prompt, own seeds: own samples
        for prompt, g in zip(PROMPTS, sampled):
            expected = recomputed_logprobs(local, prompt, g.response_ids, 0.7)
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, rtol=0, atol=ATOL)

        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        got, want = ray.get(vllm.generate.remote(PROMPTS, greedy)), local.generate(PROMPTS, greedy)
        assert [g.response_ids for g in got] == [g.response_ids for g in want]
        assert [g.finish_reason for g in got] == [g.finish_reason for g in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=ATOL)

    # A seeded call is reproducible.
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9)
    assert ray.get(vllm.generate.remote(PROMPTS, params)) == ray.get(vllm.generate.remote(PROMPTS, params))

    # Loading from a HF checkpoint directory.
    weights = random_hf_state(shape, seed=4)
    path = save_hf_checkpoint(tmp_path / "ckpt", weights, shape, tokenizer)
    ray.get(vllm.update_weights_from_dir.remote(str(path), 7))
    local.update_weights(weights, 7)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    got = ray.get(vllm.generate.remote(PROMPTS, greedy))
    assert [g.response_ids for g in got] == [g.response_ids for g in local.generate(PROMPTS, greedy)]
    assert {g.weight_version for g in got} == {7}


def test_weights_pushed_mid_generation_continue_the_requests_under_them(engines):
    """A partial rollout on vLLM: weights v9 pushed while v8 generates (the call held before its 4th engine step)
    are taken before the 5th; every unfinished request goes on from its prompt and its first 4 tokens under v9,
    exactly as v9 continues them on its own (greedy), and each token records its version."""
    engine, _, shape, _, _ = engines
    old, new = random_hf_state(shape, seed=1), random_hf_state(shape, seed=2)
    ray.get(engine.update_weights.remote(old, 8))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    reference = ray.get(engine.generate.remote(PROMPTS, greedy))
    ray.get(engine.hold_at.remote(4))
    call = engine.generate.remote(PROMPTS, greedy)
    assert ray.get(engine.wait_reached.remote(120))
    push = engine.update_weights.remote(new, 9)
    while not ray.get(engine.push_pending.remote()):
        assert not ray.wait([push], timeout=0.05)[0], "the push returned before the generate call took it"
    ray.get(engine.release.remote())
    generations, _ = ray.get(call, timeout=120), ray.get(push, timeout=120)
    kept = 4  # tokens sampled under v8: engine steps 1-4
    for prompt, generation, before in zip(PROMPTS, generations, reference):
        if len(before.response_ids) <= kept:  # finished under v8
            assert generation == before and generation.token_versions == [8] * len(before.response_ids)
            continue
        assert generation.response_ids[:kept] == before.response_ids[:kept]
        assert generation.token_versions == [8] * kept + [9] * (len(generation.response_ids) - kept)
        [rest] = ray.get(engine.generate.remote([prompt + before.response_ids[:kept]],
                                                SamplingParams(temperature=0.0, max_new_tokens=12 - kept)))
        assert generation.response_ids[kept:] == rest.response_ids
        torch.testing.assert_close(torch.tensor(generation.logprobs[kept:]), torch.tensor(rest.logprobs),
                                   rtol=0, atol=ATOL)
    assert any(set(g.token_versions) == {8, 9} for g in generations)


def test_listens_on_loopback_only_and_shuts_down_without_leftovers(engines):
    vllm, *_, ray_listeners = engines
    health = ray.get(vllm.health.remote())
    assert health["started"]
    process = psutil.Process(health["pid"])
    opened_by_vllm = listeners(process) - ray_listeners
    assert opened_by_vllm and {ip for ip, _ in opened_by_vllm} == {"127.0.0.1"}  # its Gloo group's sockets
    assert process.children(recursive=True) == []  # in-process engine: vLLM started no process of its own

    ray.get(vllm.shutdown.remote())
    assert listeners(process) == ray_listeners
    ray.kill(vllm)
    process.wait(timeout=60)
    assert not process.is_running()
