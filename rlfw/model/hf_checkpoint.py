"""Hugging Face checkpoint directories in and out: architecture, weights (safetensors) and tokenizer.

Users bring a Llama, Qwen2 or Qwen3 checkpoint as a local directory (``model.hf_path``); nothing is downloaded,
every read passes ``local_files_only``. Its ``config.json`` fills the ``model.*`` architecture keys, each
tensor-parallel rank reads only its slice of the safetensors (lazily, so a large checkpoint is not materialised
on every rank), and tasks that want the checkpoint's tokenizer get it through ``load_tokenizer``. The way out,
``save_hf_checkpoint``, writes a directory that ``AutoModelForCausalLM.from_pretrained`` and the serving engines'
load-from-disk paths (vLLM, SGLang ``update_weights_from_disk``) accept.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

from rlfw.errors import ConfigError
from rlfw.model.hf_convert import FAMILIES, LLAMA3_ROPE, check_hf_state, hf_config, hf_to_megatron
from rlfw.model.shape import ModelShape

_INDEX = "model.safetensors.index.json"
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _directory(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"HF checkpoint directory {str(path)!r} does not exist (only local directories load)")
    return directory


def read_hf_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's config; an architecture rlfw cannot convert fails here, naming its ``model_type``."""
    directory = _directory(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"HF checkpoint directory {str(directory)!r} has no config.json")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} is not supported; rlfw converts {sorted(FAMILIES)}"
        )
    return AutoConfig.from_pretrained(directory, local_files_only=True)


def architecture(config: PretrainedConfig) -> dict[str, Any]:
    """The ``model.*`` architecture keys of an HF config; raises ValueError naming any feature Megatron's layers
    lack."""
    model_type = config.model_type
    qkv_bias, qk_layernorm = FAMILIES[model_type]
    rope = dict(config.rope_parameters or {})
    unsupported = {
        "hidden_act": config.hidden_act != "silu",
        "attention_bias (bias on o_proj)": model_type != "qwen2" and getattr(config, "attention_bias", False),
        "mlp_bias": getattr(config, "mlp_bias", False),
        "use_sliding_window": getattr(config, "use_sliding_window", False),
        "layer_types (sliding-window layers)": any(
            layer != "full_attention" for layer in getattr(config, "layer_types", None) or []
        ),
        f"rope_type {rope.get('rope_type')!r} (only 'default' and 'llama3')": rope.get("rope_type", "default")
        not in ("default", "llama3"),
        f"llama3 RoPE bands other than {LLAMA3_ROPE}": rope.get("rope_type") == "llama3"
        and any(float(rope.get(key, -1)) != value for key, value in LLAMA3_ROPE.items()),
        "partial_rotary_factor": rope.get("partial_rotary_factor", 1.0) != 1.0,
    }
    features = [name for name, present in unsupported.items() if present]
    if features:
        raise ValueError(f"model_type {model_type!r} with unsupported settings: {', '.join(features)}")
    heads = config.num_attention_heads
    return {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": config.num_key_value_heads or heads,
        "ffn_hidden_size": config.intermediate_size,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "vocab_size": config.vocab_size,
        "rope_theta": float(rope["rope_theta"]),
        "norm_epsilon": float(config.rms_norm_eps),
        "qkv_bias": qkv_bias,
        "qk_layernorm": qk_layernorm,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "rope_scaling_factor": float(rope["factor"]) if rope.get("rope_type") == "llama3" else None,
    }


def fill_model_config(model_cfg) -> None:
    """Set the unset (None) architecture keys of ``model_cfg`` from ``model_cfg.hf_path``'s config.json.

    A key that is set and disagrees with the checkpoint is a ConfigError naming it: the weights could not load
    into the model it describes.
    """
    path = model_cfg.hf_path
    try:
        fields = architecture(read_hf_config(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_path={path!r}: {e}") from e
    for key, value in fields.items():
        given = model_cfg[key]
        if given is None:
            model_cfg[key] = value
        elif given != value:
            raise ConfigError(
                f"model.{key}={given} but the checkpoint in model.hf_path={path!r} has {value}; "
                f"drop the override (model=hf reads it from the checkpoint)"
            )


class _LazyTensor:
    """One tensor of a safetensors file, read only when (and as far as) it is sliced."""

    def __init__(self, handle, name: str) -> None:
        self._handle, self._name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def __getitem__(self, index) -> Tensor:
        return self._handle.get_slice(self._name)[index]


class SafetensorsCheckpoint(Mapping):
    """The tensors of a checkpoint directory by name, over ``model.safetensors`` or the shards of its index."""

    def __init__(self, path: str | Path) -> None:
        directory = _directory(path)
        index = directory / _INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"HF checkpoint directory {str(directory)!r} has no *.safetensors weights (only safetensors load)"
            )
        self._tensors: dict[str, _LazyTensor] = {}
        for name in files:
            file = directory / name
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists {name}, which is missing from {str(directory)!r}")
            handle = safe_open(file, framework="pt")
            names = handle.keys()
            for key in names:
                if key in self._tensors:
                    raise ValueError(f"tensor {key!r} appears in more than one file of {str(directory)!r}")
                self._tensors[key] = _LazyTensor(handle, key)

    def __getitem__(self, key: str) -> _LazyTensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def load_hf_weights(path: str | Path, shape: ModelShape, *modules: torch.nn.Module) -> None:
    """Copy the checkpoint into each Megatron ``GPTModel`` of ``modules`` (same shape; this rank's TP slice).

    Parameters keep their dtype and device (values are cast on copy). A tensor missing from the checkpoint or of
    the wrong shape raises ValueError naming the tensor and the directory.
    """
    from megatron.core import parallel_state

    state = hf_to_megatron(
        SafetensorsCheckpoint(path), shape,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        source=f"HF checkpoint {str(path)!r}",
    )
    for module in modules:
        module.load_state_dict(state, strict=True)


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (local files only). Usable as a Hydra ``_target_``:
    ``tokenizer: {_target_: rlfw.model.hf_checkpoint.load_tokenizer, path: ${model.hf_path}}``.

    A tokenizer saved under a generic class (``tokenizer.json`` alone holds its pipeline, as with rlfw's task
    tokenizers) loads exactly as saved: ``AutoTokenizer`` would substitute the model family's own class (it does
    for Qwen2/Qwen3 directories) and rebuild a different pipeline around the vocabulary.
    """
    directory = _directory(path)
    tokenizer_config = directory / "tokenizer_config.json"
    declared = json.loads(tokenizer_config.read_text()).get("tokenizer_class") if tokenizer_config.is_file() else None
    if declared in _GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def save_hf_checkpoint(
    directory: str | Path, hf_state: dict[str, Tensor], shape: ModelShape, tokenizer: Any | None = None
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and (if given) the tokenizer's files into a new ``directory``.

    ``hf_state`` is a full HF state dict (``megatron_to_hf``); it is checked against ``shape`` first. With tied
    embeddings ``lm_head.weight`` is left out, as HF's own ``save_pretrained`` does. The config records the
    weights' dtype, which serving engines load by default, and the tokenizer's special token ids. The files go to
    ``<directory>.partial`` first, renamed into place once complete, so a reader never sees half a checkpoint.
    """
    check_hf_state(hf_state, shape)
    out = Path(directory)
    if out.exists():
        raise FileExistsError(f"{str(out)!r} exists; an HF checkpoint is written into a new directory")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left over from an interrupted save
    partial.mkdir(parents=True)
    tensors = {
        name: tensor.detach().cpu().contiguous()
        for name, tensor in hf_state.items()
        if not (shape.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    config = hf_config(shape)
    config.dtype = next(iter(tensors.values())).dtype
    if tokenizer is not None:
        for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(config, token, getattr(tokenizer, token))
        tokenizer.save_pretrained(partial)
    config.save_pretrained(partial)
    partial.rename(out)
    return out
