"""The HF export computes the same function as the Megatron policy, and converting back loses nothing."""

import pytest
import torch
from transformers import LlamaForCausalLM

from rlfw.megatron.hf_convert import hf_config, hf_to_megatron, megatron_to_hf
from rlfw.megatron.model import ModelShape

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=32,
    max_seq_len=64,
)


@pytest.fixture(scope="module")
def megatron_model(megatron_world):
    """A single-process (gloo, TP=PP=1) Megatron GPTModel with every weight randomised.

    Megatron initialises the norm weights to one, which would hide a swapped pair of norms; random values
    everywhere make each weight matter to the logits.
    """
    from megatron.core import tensor_parallel

    from rlfw.megatron.model import build_gpt, transformer_config

    tensor_parallel.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)

    model = build_gpt(SHAPE, transformer_config(SHAPE)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def megatron_weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def test_hf_logits_match_megatron(megatron_model):
    hf_model = LlamaForCausalLM(hf_config(SHAPE)).eval()
    hf_model.load_state_dict(megatron_to_hf(megatron_model.state_dict(), SHAPE), strict=True)

    seq_len = 12
    tokens = torch.randint(0, SHAPE.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq_len).unsqueeze(0)
    future = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        megatron_logits = megatron_model(tokens, positions, future)
        hf_logits = hf_model(input_ids=tokens).logits

    assert megatron_logits.shape == hf_logits.shape == (1, seq_len, SHAPE.vocab_size)
    torch.testing.assert_close(hf_logits, megatron_logits, rtol=0, atol=1e-5)


def test_round_trip_is_bitwise(megatron_model):
    weights = megatron_weights(megatron_model)
    back = hf_to_megatron(megatron_to_hf(weights, SHAPE), SHAPE)

    assert back.keys() == weights.keys()
    for key, tensor in weights.items():
        assert back[key].dtype == tensor.dtype, key
        assert torch.equal(back[key], tensor), key


def test_dtype_is_kept(megatron_model):
    bf16 = {k: v.to(torch.bfloat16) for k, v in megatron_weights(megatron_model).items()}
    assert {t.dtype for t in megatron_to_hf(bf16, SHAPE).values()} == {torch.bfloat16}


def test_bad_keys_and_shapes_are_named(megatron_model):
    hf = megatron_to_hf(megatron_weights(megatron_model), SHAPE)

    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}, SHAPE)
    with pytest.raises(ValueError, match="model.layers.2.input_layernorm.weight"):
        hf_to_megatron({**hf, "model.layers.2.input_layernorm.weight": torch.ones(64)}, SHAPE)
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention.linear_qkv.weight"):
        weights = megatron_weights(megatron_model)
        weights["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(96, 64)
        megatron_to_hf(weights, SHAPE)
