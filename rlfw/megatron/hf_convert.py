"""Convert policy weights between Megatron-core ``GPTModel`` and Hugging Face ``LlamaForCausalLM`` names.

The trainer holds the policy as a Megatron model, while the rollout engines (the local one, vLLM) load
Hugging Face Llama checkpoints; both describe the same architecture (see ``rlfw.megatron.model``), so the
conversion is a renaming plus two layout changes:

* Megatron fuses q, k and v into one ``linear_qkv`` matrix ordered by query group (each group's q heads, then
  its k head, then its v head); HF keeps ``q_proj``, ``k_proj`` and ``v_proj`` apart, each ordered by head.
* Megatron fuses the SwiGLU gate and up projections into ``linear_fc1`` (gate rows first); HF keeps
  ``gate_proj`` and ``up_proj`` apart.

Both directions work on full, unsharded (TP=1) state dicts and check every key and shape first, so a mismatch
between the model and ``ModelShape`` fails here, naming the key, rather than as a silent garbage policy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import LlamaConfig

from rlfw.megatron.model import ModelShape

# Megatron modules with ``get_extra_state`` (FP8 metadata and the like) put these non-weight entries in their
# state dicts; they have no HF counterpart.
_EXTRA_STATE_SUFFIX = "._extra_state"


def hf_config(shape: ModelShape) -> LlamaConfig:
    """The HF config describing the same network as ``build_gpt(shape, ...)``."""
    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=shape.max_seq_len,
        rms_norm_eps=shape.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )


# (Megatron name, HF name) of the tensors that only change name; per-layer ones are relative to the layer.
_RENAMED = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
    ("output_layer.weight", "lm_head.weight"),
)
_RENAMED_IN_LAYER = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)


def _megatron_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def megatron_to_hf(state: dict[str, Tensor], shape: ModelShape) -> dict[str, Tensor]:
    """Megatron ``GPTModel`` state dict (TP=1, all layers) -> ``LlamaForCausalLM`` state dict.

    Renamed tensors are returned as they are (sharing storage with ``state``); the pieces split out of the fused
    qkv and fc1 matrices are copies with storage of their own, so the result can be pickled or saved with
    safetensors without dragging (or aliasing) the fused tensors along. Dtypes are kept.
    """
    _check(state, _megatron_shapes(shape), "Megatron", ignore=lambda key: key.endswith(_EXTRA_STATE_SUFFIX))
    hf = {hf_name: state[mc_name] for mc_name, hf_name in _RENAMED}
    q_rows, kv_rows = _q_rows_per_group(shape), shape.head_dim
    for i in range(shape.num_layers):
        mc, out = _megatron_layer(i), _hf_layer(i)
        for mc_name, hf_name in _RENAMED_IN_LAYER:
            hf[out + hf_name] = state[mc + mc_name]

        qkv = state[mc + "self_attention.linear_qkv.weight"]
        by_group = qkv.reshape(shape.num_query_groups, q_rows + 2 * kv_rows, shape.hidden_size)
        q, k, v = by_group.split([q_rows, kv_rows, kv_rows], dim=1)
        hf[out + "self_attn.q_proj.weight"] = q.reshape(-1, shape.hidden_size).clone()
        hf[out + "self_attn.k_proj.weight"] = k.reshape(-1, shape.hidden_size).clone()
        hf[out + "self_attn.v_proj.weight"] = v.reshape(-1, shape.hidden_size).clone()

        gate, up = state[mc + "mlp.linear_fc1.weight"].split(shape.ffn_hidden_size, dim=0)
        hf[out + "mlp.gate_proj.weight"] = gate.clone()
        hf[out + "mlp.up_proj.weight"] = up.clone()
    return hf


def hf_to_megatron(hf_state: dict[str, Tensor], shape: ModelShape) -> dict[str, Tensor]:
    """``LlamaForCausalLM`` state dict -> Megatron ``GPTModel`` state dict (TP=1, all layers).

    The result holds weights only, no ``_extra_state`` entries: a model built with the local layer spec accepts it
    in a strict ``load_state_dict`` (Transformer Engine layers, whose extra state is real, were not checked).
    Dtypes are kept.
    """
    _check(hf_state, _hf_shapes(shape), "HF")
    state = {mc_name: hf_state[hf_name] for mc_name, hf_name in _RENAMED}
    for i in range(shape.num_layers):
        mc, src = _megatron_layer(i), _hf_layer(i)
        for mc_name, hf_name in _RENAMED_IN_LAYER:
            state[mc + mc_name] = hf_state[src + hf_name]

        q, k, v = (
            hf_state[src + f"self_attn.{name}.weight"].reshape(shape.num_query_groups, -1, shape.hidden_size)
            for name in ("q_proj", "k_proj", "v_proj")
        )
        state[mc + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, shape.hidden_size)
        state[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[src + "mlp.gate_proj.weight"], hf_state[src + "mlp.up_proj.weight"]], dim=0
        )
    return state


def _q_rows_per_group(shape: ModelShape) -> int:
    return shape.num_attention_heads // shape.num_query_groups * shape.head_dim


def _megatron_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    h, qkv_rows = shape.hidden_size, shape.num_query_groups * (_q_rows_per_group(shape) + 2 * shape.head_dim)
    shapes = {
        "embedding.word_embeddings.weight": (shape.vocab_size, h),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (shape.vocab_size, h),
    }
    for i in range(shape.num_layers):
        layer = _megatron_layer(i)
        shapes[layer + "input_layernorm.weight"] = (h,)
        shapes[layer + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
        shapes[layer + "self_attention.linear_proj.weight"] = (h, shape.num_attention_heads * shape.head_dim)
        shapes[layer + "pre_mlp_layernorm.weight"] = (h,)
        shapes[layer + "mlp.linear_fc1.weight"] = (2 * shape.ffn_hidden_size, h)
        shapes[layer + "mlp.linear_fc2.weight"] = (h, shape.ffn_hidden_size)
    return shapes


def _hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    h, q_dim, kv_dim = (
        shape.hidden_size,
        shape.num_attention_heads * shape.head_dim,
        shape.num_query_groups * shape.head_dim,
    )
    shapes = {
        "model.embed_tokens.weight": (shape.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (shape.vocab_size, h),
    }
    for i in range(shape.num_layers):
        layer = _hf_layer(i)
        shapes[layer + "input_layernorm.weight"] = (h,)
        shapes[layer + "self_attn.q_proj.weight"] = (q_dim, h)
        shapes[layer + "self_attn.k_proj.weight"] = (kv_dim, h)
        shapes[layer + "self_attn.v_proj.weight"] = (kv_dim, h)
        shapes[layer + "self_attn.o_proj.weight"] = (h, q_dim)
        shapes[layer + "post_attention_layernorm.weight"] = (h,)
        shapes[layer + "mlp.gate_proj.weight"] = (shape.ffn_hidden_size, h)
        shapes[layer + "mlp.up_proj.weight"] = (shape.ffn_hidden_size, h)
        shapes[layer + "mlp.down_proj.weight"] = (h, shape.ffn_hidden_size)
    return shapes


def _check(
    state: dict[str, Tensor],
    expected: dict[str, tuple[int, ...]],
    kind: str,
    ignore: Callable[[str], bool] = lambda key: False,
) -> None:
    """Raise ValueError naming every missing or unexpected key, or the first tensor of the wrong shape."""
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(key for key in state.keys() - expected.keys() if not ignore(key))
    if missing or unexpected:
        raise ValueError(f"{kind} state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for key, want in expected.items():
        if tuple(state[key].shape) != want:
            raise ValueError(f"{kind} state dict: {key!r} has shape {tuple(state[key].shape)}, expected {want}")
