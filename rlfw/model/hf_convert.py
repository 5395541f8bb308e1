"""Convert policy weights between Megatron-core ``GPTModel`` and Hugging Face Llama, Qwen2 and Qwen3 names.

The trainer holds the policy as a Megatron model, while the rollout engines (the local one, vLLM) load Hugging
Face checkpoints; both describe the same network (see ``rlfw.megatron.model``), so the conversion is a renaming
plus two layout changes:

* Megatron fuses q, k and v into one ``linear_qkv`` matrix (and bias, Qwen2) ordered by query group (each group's
  q heads, then its k head, then its v head); HF keeps ``q_proj``, ``k_proj`` and ``v_proj`` apart, each ordered
  by head.
* Megatron fuses the SwiGLU gate and up projections into ``linear_fc1`` (gate rows first); HF keeps
  ``gate_proj`` and ``up_proj`` apart.

The family follows from two switches of ``ModelShape``: q/k/v biases make it Qwen2, q/k norms Qwen3, neither
Llama (with plain or Llama 3.x scaled RoPE). Every tensor's shape is checked against the shape first, so a checkpoint that does not match fails here,
naming the tensor, rather than as a silent garbage policy.

Why not Megatron-Bridge (the NVIDIA converter, ``megatron-bridge`` on PyPI): no release fits rlfw's pins. The only
releases installable on Python 3.11, 0.3.0 and 0.3.1, require ``transformers<5.0.0`` (rlfw pins 5.19.0, which
vLLM needs), ``hydra-core<=1.3.2`` (rlfw: 1.3.8) and ``transformer-engine[core_cu13,pytorch]>=2.10`` (a CUDA
build; rlfw runs without Transformer Engine); every later release (0.4.0 to 0.6.2) declares
``Requires-Python >=3.12,<3.13``, and 0.6.2 also ``transformers<=5.12.1``. So rlfw keeps its own converter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PretrainedConfig

from rlfw.model.shape import ModelShape

# Megatron modules with ``get_extra_state`` (FP8 metadata and the like) put these non-weight entries in their
# state dicts; they have no HF counterpart.
_EXTRA_STATE_SUFFIX = "._extra_state"

# HF ``model_type`` -> (qkv_bias, qk_layernorm) of the families whose layers Megatron's local spec reproduces.
FAMILIES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}

# The Llama 3.x frequency bands Megatron's RoPE scaling hard-codes; a checkpoint with other values cannot load.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# A tensor or anything sliced like one (a lazily read safetensors tensor): ``.shape`` and ``[a:b]`` / ``[:, a:b]``.
Sliceable = Any

# How a tensor is split over tensor-parallel ranks: ROWS (column-parallel linears, the vocab-parallel embedding),
# COLS (row-parallel linears), or REPLICATED (norms). Matches Megatron's ``partition_dim``.
ROWS, COLS, REPLICATED = 0, 1, None

# (Megatron name, HF name, partition) of the tensors that only change name; per-layer ones are relative to a layer.
_RENAMED = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight", ROWS),
    ("decoder.final_layernorm.weight", "model.norm.weight", REPLICATED),
)
_OUTPUT = ("output_layer.weight", "lm_head.weight", ROWS)
_RENAMED_IN_LAYER = (
    ("input_layernorm.weight", "input_layernorm.weight", REPLICATED),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", COLS),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", REPLICATED),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", COLS),
)
_QK_NORMS = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", REPLICATED),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", REPLICATED),
)


def hf_model_type(shape: ModelShape) -> str:
    """The HF family computing the same function as ``shape``."""
    for model_type, switches in FAMILIES.items():
        if switches == (shape.qkv_bias, shape.qk_layernorm):
            return model_type
    raise ValueError("no supported HF family has both q/k/v biases and q/k norms (Qwen2 has biases, Qwen3 norms)")


def hf_config(shape: ModelShape) -> PretrainedConfig:
    """The HF config (``LlamaConfig``, ``Qwen2Config`` or ``Qwen3Config``) of the network ``build_gpt`` builds.
    (transformers is imported here, not with the module: a trainer converts its weights at every export and needs
    no HF config, and importing transformers would delay its first export by a second or more.)"""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf_model_type(shape)
    family_switches = {
        "llama": {"attention_bias": False, "mlp_bias": False},
        "qwen2": {"use_sliding_window": False},
        "qwen3": {"attention_bias": False, "use_sliding_window": False},
    }
    return AutoConfig.for_model(
        model_type,
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]],  # the class serving engines instantiate
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
        rope_parameters=rope_parameters(shape),
        tie_word_embeddings=shape.tie_word_embeddings,
        **family_switches[model_type],
    )


def rope_parameters(shape: ModelShape) -> dict:
    """HF ``rope_parameters`` of the shape's RoPE: plain, or Llama 3.x scaled."""
    if shape.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": shape.rope_theta}
    return {"rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": shape.rope_scaling_factor, **LLAMA3_ROPE}


def _megatron_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _renamed(shape: ModelShape) -> list[tuple[str, str, int | None]]:
    """Every (Megatron name, HF name, partition) of a tensor that only changes name, for all layers."""
    pairs = list(_RENAMED) + ([] if shape.tie_word_embeddings else [_OUTPUT])
    in_layer = _RENAMED_IN_LAYER + (_QK_NORMS if shape.qk_layernorm else ())
    for i in range(shape.num_layers):
        pairs += [(_megatron_layer(i) + mc, _hf_layer(i) + hf, part) for mc, hf, part in in_layer]
    return pairs


def megatron_to_hf(state: dict[str, Tensor], shape: ModelShape) -> dict[str, Tensor]:
    """Megatron ``GPTModel`` state dict (TP=1, all layers) -> the HF model's state dict.

    Renamed tensors are returned as they are (sharing storage with ``state``); the pieces split out of the fused
    qkv and fc1 tensors are copies with storage of their own, so the result can be pickled or saved with
    safetensors without dragging (or aliasing) the fused tensors along. With tied embeddings ``lm_head.weight`` is
    the embedding tensor itself, as in the HF model's own ``state_dict()``. Dtypes are kept.
    """
    _check(state, _megatron_shapes(shape), "Megatron", ignore=lambda key: key.endswith(_EXTRA_STATE_SUFFIX))
    hf = {hf_name: state[mc_name] for mc_name, hf_name, _ in _renamed(shape)}
    if shape.tie_word_embeddings:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    fused_qkv = ["weight", "bias"] if shape.qkv_bias else ["weight"]
    for i in range(shape.num_layers):
        mc, out = _megatron_layer(i), _hf_layer(i)
        for kind in fused_qkv:
            pieces = _split_qkv(state[mc + f"self_attention.linear_qkv.{kind}"], shape)
            for name, piece in zip(("q_proj", "k_proj", "v_proj"), pieces):
                hf[out + f"self_attn.{name}.{kind}"] = piece
        gate, up = state[mc + "mlp.linear_fc1.weight"].split(shape.ffn_hidden_size, dim=0)
        hf[out + "mlp.gate_proj.weight"] = gate.clone()
        hf[out + "mlp.up_proj.weight"] = up.clone()
    return hf


def hf_to_megatron(
    hf_state: Mapping[str, Sliceable], shape: ModelShape, tp_rank: int = 0, tp_size: int = 1, source: str = "HF"
) -> dict[str, Tensor]:
    """HF state dict -> tensor-parallel rank ``tp_rank``'s shard of the Megatron ``GPTModel`` state dict.

    ``hf_state`` holds full (unsharded) tensors, or lazy ones that read only the slice asked for (see
    ``rlfw.model.hf_checkpoint``), so each rank reads just its share of a large checkpoint. The layout is
    Megatron's: a column-parallel weight's rows and a row-parallel weight's columns split into ``tp_size``
    contiguous blocks; the fused qkv takes the rank's query groups from each of q, k and v; the fused fc1 is
    [gate shard; up shard]. With tied embeddings an ``lm_head.weight`` entry (HF's ``state_dict()`` has one,
    its files do not) is ignored, as HF itself does.

    The result holds weights only, no ``_extra_state`` entries: a model built with the local layer spec accepts it
    in a strict ``load_state_dict`` (Transformer Engine layers, whose extra state is real, were not checked).
    Dtypes are kept. ``source`` names the input in error messages (a checkpoint's path).
    """
    check_hf_state(hf_state, shape, source)

    def shard(tensor: Sliceable, partition: int | None) -> Tensor:
        if partition is REPLICATED:
            return tensor[:]
        size = tensor.shape[partition] // tp_size
        block = slice(tp_rank * size, (tp_rank + 1) * size)
        return tensor[block] if partition == ROWS else tensor[:, block]

    state = {mc_name: shard(hf_state[hf_name], part) for mc_name, hf_name, part in _renamed(shape)}
    groups = shape.num_query_groups // tp_size
    for i in range(shape.num_layers):
        mc, src = _megatron_layer(i), _hf_layer(i)
        for kind in ["weight", "bias"] if shape.qkv_bias else ["weight"]:
            q, k, v = (shard(hf_state[src + f"self_attn.{name}.{kind}"], ROWS) for name in ("q_proj", "k_proj", "v_proj"))
            by_group = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
            state[mc + f"self_attention.linear_qkv.{kind}"] = torch.cat(by_group, dim=1).reshape(-1, *q.shape[1:])
        state[mc + "mlp.linear_fc1.weight"] = torch.cat(
            [shard(hf_state[src + "mlp.gate_proj.weight"], ROWS), shard(hf_state[src + "mlp.up_proj.weight"], ROWS)]
        )
    return state


def check_hf_state(hf_state: Mapping[str, Sliceable], shape: ModelShape, source: str = "HF") -> None:
    """Raise ValueError naming the first missing, unexpected or misshapen tensor of an HF state dict for ``shape``
    (a tied model's ``lm_head.weight`` may be there or not)."""
    tied_head = shape.tie_word_embeddings
    _check(hf_state, _hf_shapes(shape), source, ignore=lambda key: tied_head and key == "lm_head.weight")


def _split_qkv(fused: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron's group-ordered ``linear_qkv`` weight or bias -> HF's q, k and v (copies, ordered by head)."""
    rest = fused.shape[1:]
    by_group = fused.reshape(shape.num_query_groups, _q_rows_per_group(shape) + 2 * shape.head_dim, *rest)
    pieces = by_group.split([_q_rows_per_group(shape), shape.head_dim, shape.head_dim], dim=1)
    return tuple(piece.reshape(-1, *rest).clone() for piece in pieces)


def _q_rows_per_group(shape: ModelShape) -> int:
    return shape.num_attention_heads // shape.num_query_groups * shape.head_dim


def _megatron_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    h, qkv_rows = shape.hidden_size, shape.num_query_groups * (_q_rows_per_group(shape) + 2 * shape.head_dim)
    shapes = {
        "embedding.word_embeddings.weight": (shape.vocab_size, h),
        "decoder.final_layernorm.weight": (h,),
    }
    if not shape.tie_word_embeddings:
        shapes["output_layer.weight"] = (shape.vocab_size, h)
    for i in range(shape.num_layers):
        layer = _megatron_layer(i)
        shapes[layer + "input_layernorm.weight"] = (h,)
        shapes[layer + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
        if shape.qkv_bias:
            shapes[layer + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        if shape.qk_layernorm:
            shapes[layer + "self_attention.q_layernorm.weight"] = (shape.head_dim,)
            shapes[layer + "self_attention.k_layernorm.weight"] = (shape.head_dim,)
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
    }
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    for i in range(shape.num_layers):
        layer = _hf_layer(i)
        shapes[layer + "input_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            shapes[layer + f"self_attn.{name}.weight"] = (rows, h)
            if shape.qkv_bias:
                shapes[layer + f"self_attn.{name}.bias"] = (rows,)
        if shape.qk_layernorm:
            shapes[layer + "self_attn.q_norm.weight"] = (shape.head_dim,)
            shapes[layer + "self_attn.k_norm.weight"] = (shape.head_dim,)
        shapes[layer + "self_attn.o_proj.weight"] = (h, q_dim)
        shapes[layer + "post_attention_layernorm.weight"] = (h,)
        shapes[layer + "mlp.gate_proj.weight"] = (shape.ffn_hidden_size, h)
        shapes[layer + "mlp.up_proj.weight"] = (shape.ffn_hidden_size, h)
        shapes[layer + "mlp.down_proj.weight"] = (h, shape.ffn_hidden_size)
    return shapes


def _check(
    state: Mapping[str, Sliceable],
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
