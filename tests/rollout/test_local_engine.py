"""The local engine's sampling loop: KV cache and left padding are exact, stopping and seeding behave. Each test
runs both decoders: ``lockstep`` (CPU's) and ``slots`` (CUDA's continuous batching, here on CPU in fp32 with two
slots for three prompts, so that a finished sequence's slot takes the next prompt)."""

import pytest
import torch

from rlfw.model.shape import ModelShape
from rlfw.rollout.engines import LocalEngine
from rlfw.rollout.types import SamplingParams

torch.set_num_threads(1)

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=16,
    max_seq_len=64,
)
EOS, PAD = 2, 0
# Different lengths, so that every batch needs left padding.
PROMPTS = [[1, 5, 6, 7, 3], [1, 9, 3], [1, 4, 4, 4, 4, 4, 4, 3]]


DECODERS = {"lockstep": {"decoder": "lockstep"}, "slots": {"decoder": "slots", "max_batch": 2}}


@pytest.fixture(params=sorted(DECODERS))
def decoder(request):
    return request.param


def make_engine(seed: int = 0, eos_token_id: int = EOS, decoder: str = "lockstep", **kwargs) -> LocalEngine:
    """An engine with fixed random weights, larger than HF's init so that logits are far from uniform."""
    engine = LocalEngine(SHAPE, eos_token_id=eos_token_id, pad_token_id=PAD, seed=seed,
                         **{**DECODERS[decoder], **kwargs})
    generator = torch.Generator().manual_seed(1234)
    weights = {k: torch.randn(v.shape, generator=generator) * 0.5 for k, v in engine.model.state_dict().items()}
    engine.update_weights(weights, version=3)
    return engine


def test_update_weights_records_version(decoder):
    assert make_engine(decoder=decoder).weight_version == 3
    with pytest.raises(RuntimeError, match="update_weights"):
        LocalEngine(SHAPE, EOS, PAD, seed=0).generate(PROMPTS, SamplingParams(max_new_tokens=1))


def test_greedy_matches_hf_generate(decoder):
    engine = make_engine(decoder=decoder)
    generations = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))

    for prompt, generation in zip(PROMPTS, generations):
        expected = engine.model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD
        )[0, len(prompt) :].tolist()
        assert generation.response_ids == expected
        assert generation.finish_reason == ("stop" if expected[-1] == EOS else "length")


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_match_full_forward(temperature, top_p, decoder):
    engine = make_engine(decoder=decoder)
    generations = engine.generate(PROMPTS, SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=10))

    for prompt, generation in zip(PROMPTS, generations):
        response = torch.tensor(generation.response_ids)
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt + generation.response_ids])).logits[0]
        # Logits at position t predict token t + 1.
        scaled = logits[len(prompt) - 1 : -1] / (temperature or 1.0)
        expected = torch.log_softmax(scaled, dim=-1).gather(-1, response[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, rtol=0, atol=1e-5)


def test_sequences_stop_at_eos_and_others_continue(decoder):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    # vocab_size is an id the model never produces, so nothing stops early here.
    unstopped = make_engine(eos_token_id=SHAPE.vocab_size, decoder=decoder).generate(PROMPTS, params)
    eos = unstopped[0].response_ids[2]

    generations = make_engine(eos_token_id=eos, decoder=decoder).generate(PROMPTS, params)

    for full, generation in zip(unstopped, generations):
        if eos in full.response_ids:
            expected, reason = full.response_ids[: full.response_ids.index(eos) + 1], "stop"
        else:
            expected, reason = full.response_ids, "length"
        assert generation.response_ids == expected
        assert generation.finish_reason == reason
        assert len(generation.logprobs) == len(expected)
    assert {g.finish_reason for g in generations} == {"stop", "length"}


def test_sampling_is_deterministic_for_a_seed(decoder):
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    first = make_engine(seed=7, decoder=decoder).generate(PROMPTS, params)

    assert make_engine(seed=7, decoder=decoder).generate(PROMPTS, params) == first
    assert make_engine(seed=8, decoder=decoder).generate(PROMPTS, params) != first


def test_tiny_top_p_samples_the_greedy_tokens(decoder):
    engine = make_engine(decoder=decoder)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10))
    nucleus_of_one = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=10))

    assert nucleus_of_one == greedy


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0)]
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{"max_new_tokens": 4, field: value})


def test_weights_pushed_mid_generation_continue_the_responses_under_them(decoder):
    """A partial rollout: weights v4 pushed while v3 decodes are taken before the next decode step; every response
    goes on from its prompt and the tokens sampled so far under v4, as if v4 had been asked to continue them, and
    each token records the version that sampled it."""
    import threading

    engine = make_engine(decoder=decoder, max_batch=0)  # v3; every prompt decodes from the first step
    generator = torch.Generator().manual_seed(99)
    newer = {k: torch.randn(v.shape, generator=generator) * 0.5 for k, v in engine.model.state_dict().items()}
    switch_at = 4  # decode steps under v3; the push lands while the 5th step's sampling is held
    reached, go = threading.Event(), threading.Event()
    sample, calls = engine._sample, []

    def held_sample(logits, params):  # test hook on the real sampler: hold one decode step so the push lands in it
        calls.append(1)
        if len(calls) == switch_at:
            reached.set()
            assert go.wait(30)
        return sample(logits, params)

    engine._sample = held_sample
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    out = {}
    decoding = threading.Thread(target=lambda: out.update(result=engine.generate(PROMPTS, params)))
    decoding.start()
    assert reached.wait(30)
    pushing = threading.Thread(target=engine.update_weights, args=(newer, 4))
    pushing.start()
    while engine._handoff._pending is None:  # the push is registered, waiting for the next decode step
        assert pushing.is_alive()
        pushing.join(0.01)
    go.set()
    decoding.join(60)
    pushing.join(60)
    assert not decoding.is_alive() and not pushing.is_alive()
    assert engine.weight_version == 4

    old, new = make_engine(decoder=decoder), make_engine(decoder=decoder)
    new.update_weights(newer, 4)
    for prompt, generation in zip(PROMPTS, out["result"]):
        kept = generation.response_ids[:switch_at]
        assert generation.token_versions == [3] * len(kept) + [4] * (len(generation.response_ids) - len(kept))
        assert generation.weight_version == 3
        first = old.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=switch_at))[0]
        assert first.response_ids[: len(kept)] == kept
        assert first.logprobs[: len(kept)] == pytest.approx(generation.logprobs[:switch_at], abs=1e-5)
        if len(kept) == switch_at and kept[-1] != EOS:  # the response went on under v4
            rest = new.generate([prompt + kept], SamplingParams(temperature=0.0, max_new_tokens=12 - switch_at))[0]
            assert generation.response_ids[switch_at:] == rest.response_ids
            assert generation.logprobs[switch_at:] == pytest.approx(rest.logprobs, abs=1e-5)
    assert any(len(set(g.token_versions)) == 2 for g in out["result"])


def test_weights_pushed_between_calls_load_at_once(decoder):
    engine = make_engine(decoder=decoder)
    engine.update_weights(engine.model.state_dict(), 9)  # no call under way: loaded before it returns
    assert engine.weight_version == 9 and engine._handoff._pending is None
    generation = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=3))[0]
    assert set(generation.token_versions) == {9}


@pytest.mark.parametrize("max_batch", [0, 5])
def test_slots_decode_what_lockstep_decodes(max_batch):
    """Continuous batching changes where a sequence sits, never what it samples: twelve prompts that stop at
    different lengths, decoded in 12 slots (the survivors moved into the lowest 8 once few are left) or 5 (each
    freed slot refilled), give lockstep's greedy tokens and log-probs."""
    generator = torch.Generator().manual_seed(5)
    prompts = [[1] + torch.randint(3, SHAPE.vocab_size, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 9, (12,), generator=generator)]
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    unstopped = make_engine(eos_token_id=SHAPE.vocab_size).generate(prompts, params)
    eos = max(range(3, SHAPE.vocab_size), key=lambda t: sum(t in g.response_ids for g in unstopped))
    lockstep = make_engine(eos_token_id=eos).generate(prompts, params)
    slots = make_engine(eos_token_id=eos, decoder="slots", max_batch=max_batch).generate(prompts, params)

    assert len({len(g.response_ids) for g in lockstep}) > 3  # a long tail: many lengths
    for want, got in zip(lockstep, slots):
        assert got.response_ids == want.response_ids
        assert got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
