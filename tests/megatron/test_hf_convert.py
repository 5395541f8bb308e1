"""The HF export computes the same function as the Megatron policy, for every family, and converting back loses
nothing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfw.model.hf_convert import hf_config, hf_model_type, hf_to_megatron, megatron_to_hf
from rlfw.model.shape import ModelShape

BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 128,
        "vocab_size": 32, "max_seq_len": 64}
SHAPES = {
    "llama": ModelShape(**BASE),
    # Qwen2: q/k/v biases; tied embeddings as in the small Qwen2 models.
    "qwen2": ModelShape(**BASE, rope_theta=1e6, norm_epsilon=1e-6, qkv_bias=True, tie_word_embeddings=True),
    # Qwen3: q/k norms and a head width that is not hidden / heads (24 != 16), as in the Qwen3 models.
    "qwen3": ModelShape(**BASE, rope_theta=1e6, norm_epsilon=1e-6, head_dim=24, qk_layernorm=True),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# fp32 on both sides; the attention kernels and norm implementations differ, so not bitwise.
LOGITS_ATOL = 1e-5


def randomised_gpt(shape: ModelShape, tp: int = 1, seed: int = 0):
    """A Megatron GPTModel (parallel_state initialised) with every weight randomised.

    Megatron initialises the norm weights to one and biases to zero, which would hide a swapped pair of norms or a
    misplaced bias; random values everywhere make each weight matter to the logits.
    """
    from rlfw.megatron.model import build_gpt, transformer_config

    model = build_gpt(shape, transformer_config(shape, tp=tp)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [1, T, V] of a (possibly tensor-parallel) Megatron GPTModel."""
    from megatron.core import tensor_parallel

    seq_len = tokens.shape[1]
    future = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = model(tokens, torch.arange(seq_len).unsqueeze(0), future)
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def random_tokens(vocab_size: int, seq_len: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed))


def megatron_weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request, megatron_world):
    """(family name, its shape, a randomised single-process TP=1 Megatron model of that shape)."""
    shape = SHAPES[request.param]
    return request.param, shape, randomised_gpt(shape)


def test_the_shape_names_its_family(family):
    name, shape, _ = family
    assert hf_model_type(shape) == name
    config = hf_config(shape)
    assert config.model_type == name and config.architectures == [HF_CLASSES[name]]
    assert config.head_dim == shape.head_dim and config.tie_word_embeddings == shape.tie_word_embeddings


def test_hf_logits_match_megatron(family):
    name, shape, model = family
    hf_model = AutoModelForCausalLM.from_config(hf_config(shape)).eval()
    assert type(hf_model).__name__ == HF_CLASSES[name]
    hf_model.load_state_dict(megatron_to_hf(model.state_dict(), shape), strict=True)

    tokens = random_tokens(shape.vocab_size)
    with torch.no_grad():
        hf_logits = hf_model(input_ids=tokens).logits
    expected = megatron_logits(model, tokens)
    assert expected.shape == hf_logits.shape == (1, tokens.shape[1], shape.vocab_size)
    torch.testing.assert_close(hf_logits, expected, rtol=0, atol=LOGITS_ATOL)


def test_round_trip_is_bitwise(family):
    _, shape, model = family
    weights = megatron_weights(model)
    back = hf_to_megatron(megatron_to_hf(weights, shape), shape)

    assert back.keys() == weights.keys()
    for key, tensor in weights.items():
        assert back[key].dtype == tensor.dtype, key
        assert torch.equal(back[key], tensor), key


def test_tied_export_shares_the_embedding(megatron_world):
    shape = SHAPES["qwen2"]
    weights = megatron_weights(randomised_gpt(shape))
    assert "output_layer.weight" not in weights
    hf = megatron_to_hf(weights, shape)
    assert hf["lm_head.weight"] is hf["model.embed_tokens.weight"]
    # Files of tied checkpoints have no lm_head: the import accepts both forms.
    without_head = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    assert hf_to_megatron(without_head, shape).keys() == hf_to_megatron(hf, shape).keys() == weights.keys()


def test_dtype_is_kept(family):
    _, shape, model = family
    bf16 = {k: v.to(torch.bfloat16) for k, v in megatron_weights(model).items()}
    assert {t.dtype for t in megatron_to_hf(bf16, shape).values()} == {torch.bfloat16}


def test_bad_keys_and_shapes_are_named(family):
    name, shape, model = family
    hf = megatron_to_hf(megatron_weights(model), shape)

    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}, shape)
    with pytest.raises(ValueError, match="model.layers.2.input_layernorm.weight"):
        hf_to_megatron({**hf, "model.layers.2.input_layernorm.weight": torch.ones(64)}, shape)
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention.linear_qkv.weight"):
        weights = megatron_weights(model)
        weights["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(96, 64)
        megatron_to_hf(weights, shape)
    if name == "qwen2":  # a Qwen2 checkpoint without its biases is not silently loaded as Llama
        with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.bias"):
            hf_to_megatron({k: v for k, v in hf.items() if k != "model.layers.0.self_attn.k_proj.bias"}, shape)
    if name == "qwen3":
        with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.q_norm.weight' has shape \(16,\)"):
            hf_to_megatron({**hf, "model.layers.1.self_attn.q_norm.weight": torch.ones(16)}, shape)


def test_no_family_has_both_biases_and_qk_norms():
    with pytest.raises(ValueError, match="both q/k/v biases and q/k norms"):
        hf_config(ModelShape(**BASE, qkv_bias=True, qk_layernorm=True))
