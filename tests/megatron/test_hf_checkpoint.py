"""HF checkpoint directories in and out: a Llama, Qwen2 or Qwen3 saved by transformers loads into Megatron (at TP=1
and TP=2) and computes the same logits; what rlfw writes back is the same checkpoint, bit for bit.

The checkpoints are tiny random models built here with ``from_config`` and ``save_pretrained``: nothing is
downloaded.
"""

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from safetensors.torch import load_file
import forked
from test_hf_convert import LOGITS_ATOL, megatron_logits, megatron_weights, random_tokens
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rlfw.config import ConfigError, register_configs
from rlfw.model.hf_checkpoint import (
    architecture,
    fill_model_config,
    load_hf_weights,
    load_tokenizer,
    read_hf_config,
    save_hf_checkpoint,
)
from rlfw.model.hf_convert import megatron_to_hf
from rlfw.model.shape import ModelShape
from rlfw.rollout.tokenizer import build_tokenizer

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()

COMMON = {"vocab_size": 48, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "hidden_act": "silu"}
HF_CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, rms_norm_eps=1e-5,
                                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    # Llama 3.x RoPE scaling; theta 1e4 puts the head's slowest frequencies in the scaled and smoothed bands.
    "llama3": lambda: LlamaConfig(**COMMON, rms_norm_eps=1e-5, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "qwen2": lambda: Qwen2Config(**COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": lambda: Qwen3Config(**COMMON, rms_norm_eps=1e-6, head_dim=32,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}
# What each config.json above means for rlfw, written out by hand.
SHAPE_KEYS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 96, "vocab_size": 48}
ARCHITECTURES = {
    "llama": {"head_dim": 16, "rope_theta": 500000.0, "norm_epsilon": 1e-5, "qkv_bias": False,
              "qk_layernorm": False, "tie_word_embeddings": False, "rope_scaling_factor": None},
    "llama3": {"head_dim": 16, "rope_theta": 10000.0, "norm_epsilon": 1e-5, "qkv_bias": False,
               "qk_layernorm": False, "tie_word_embeddings": False, "rope_scaling_factor": 32.0},
    "qwen2": {"head_dim": 16, "rope_theta": 1e6, "norm_epsilon": 1e-6, "qkv_bias": True, "qk_layernorm": False,
              "tie_word_embeddings": True, "rope_scaling_factor": None},
    "qwen3": {"head_dim": 32, "rope_theta": 1e6, "norm_epsilon": 1e-6, "qkv_bias": False, "qk_layernorm": True,
              "tie_word_embeddings": False, "rope_scaling_factor": None},
}


def save_random_checkpoint(config, directory: Path, seed: int = 0, **save_kwargs) -> Path:
    """A transformers model of ``config`` with every weight random (norms and biases too), saved with its
    tokenizer."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(directory, **save_kwargs)
    build_tokenizer([f"w{i}" for i in range(8)]).save_pretrained(directory)
    return directory


def shape_of(path: Path, max_seq_len: int = 64) -> ModelShape:
    return ModelShape(**architecture(read_hf_config(path)), max_seq_len=max_seq_len)


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def imported_gpt(path: Path, tp: int = 1):
    from rlfw.megatron.model import build_gpt, transformer_config

    shape = shape_of(path)
    model = build_gpt(shape, transformer_config(shape, tp=tp)).eval()
    load_hf_weights(path, shape, model)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_random_checkpoint(make(), root / name) for name, make in HF_CONFIGS.items()}


@pytest.fixture(params=sorted(HF_CONFIGS))
def name(request) -> str:
    return request.param


def test_architecture_is_read_from_config_json(checkpoints, name):
    assert architecture(read_hf_config(checkpoints[name])) == {**SHAPE_KEYS, **ARCHITECTURES[name]}


def test_imported_model_computes_the_checkpoint_logits(checkpoints, name, megatron_world):
    tokens = random_tokens(48, seq_len=16)
    expected = hf_logits(checkpoints[name], tokens)
    torch.testing.assert_close(megatron_logits(imported_gpt(checkpoints[name]), tokens), expected, rtol=0,
                               atol=LOGITS_ATOL)


def test_import_then_export_gives_back_the_files_bitwise(checkpoints, name, megatron_world, tmp_path):
    path = checkpoints[name]
    shape = shape_of(path)
    exported = megatron_to_hf(megatron_weights(imported_gpt(path)), shape)
    on_disk = load_file(path / "model.safetensors")
    if shape.tie_word_embeddings:  # the files of a tied model hold no lm_head; the state dict shares the embedding
        assert "lm_head.weight" not in on_disk
        on_disk["lm_head.weight"] = on_disk["model.embed_tokens.weight"]
    assert exported.keys() == on_disk.keys()
    for key, tensor in on_disk.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key

    out = save_hf_checkpoint(tmp_path / "export", exported, shape, tokenizer=load_tokenizer(path))
    written = load_file(out / "model.safetensors")
    assert written.keys() == load_file(path / "model.safetensors").keys()
    assert all(torch.equal(written[key], tensor) for key, tensor in load_file(path / "model.safetensors").items())
    # transformers loads it as the same family and computes the same function, bit for bit.
    tokens = random_tokens(48, seq_len=16)
    assert torch.equal(hf_logits(out, tokens), hf_logits(path, tokens))
    config = json.loads((out / "config.json").read_text())
    original = HF_CONFIGS[name]()
    assert config["model_type"] == original.model_type and config["rope_parameters"] == original.rope_parameters
    assert config["architectures"] == [type(AutoModelForCausalLM.from_config(original)).__name__]
    assert config["eos_token_id"] == 2 and config["dtype"] == "float32"
    assert load_tokenizer(out).encode("<bos> w3 = w1") == [1, 7, 3, 5]
    with pytest.raises(FileExistsError, match="export"):  # never written over
        save_hf_checkpoint(out, exported, shape)


def test_sharded_checkpoint_loads(tmp_path, megatron_world):
    path = save_random_checkpoint(HF_CONFIGS["qwen3"](), tmp_path / "sharded", seed=3, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    tokens = random_tokens(48, seq_len=16)
    torch.testing.assert_close(megatron_logits(imported_gpt(path), tokens), hf_logits(path, tokens), rtol=0,
                               atol=LOGITS_ATOL)


def _tensor_parallel_rank(rank: int, store_port: int, checkpoints: dict[str, str], out: str) -> None:
    """One rank of a two-process TP=2 world: import every checkpoint, write the gathered logits (rank 0)."""
    import os

    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    from megatron.core import parallel_state, tensor_parallel

    from rlfw.cluster.store import connect_store
    from rlfw.megatron.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    dist.init_process_group("gloo", store=connect_store("127.0.0.1", store_port), rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    parallel_state.initialize_model_parallel(2, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)
    tokens = random_tokens(48, seq_len=16)
    logits = {name: megatron_logits(imported_gpt(Path(path), tp=2), tokens) for name, path in checkpoints.items()}
    if rank == 0:
        torch.save(logits, out)
    dist.destroy_process_group()


def test_tensor_parallel_import_matches_tp1(checkpoints, megatron_world, tmp_path):
    """Each TP rank loads only its slice (query groups of the fused qkv, [gate; up] of fc1, vocab rows); the
    gathered logits equal the TP=1 model's up to the order of the row-parallel sums."""
    from rlfw.cluster.store import serve_store

    store = serve_store("127.0.0.1")
    out = tmp_path / "tp2_logits.pt"
    forked.start_processes(_tensor_parallel_rank, (store.port, {k: str(v) for k, v in checkpoints.items()}, str(out)),
                           2)
    tp2 = torch.load(out)
    tokens = random_tokens(48, seq_len=16)
    assert tp2.keys() == checkpoints.keys()
    for name, path in checkpoints.items():
        torch.testing.assert_close(tp2[name], megatron_logits(imported_gpt(path), tokens), rtol=0, atol=LOGITS_ATOL)


# ------------------------------------------------------------------------------------------------- bad input
def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_hf_config(missing)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(missing)


def test_checkpoint_without_safetensors_is_named(checkpoints, tmp_path, megatron_world):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"bare.*no \*\.safetensors"):
        imported_gpt(bare)


def test_index_naming_a_missing_shard_is_named(tmp_path, megatron_world):
    path = save_random_checkpoint(HF_CONFIGS["llama"](), tmp_path / "sharded", max_shard_size="20KB")
    shard = max(path.glob("*.safetensors"))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        imported_gpt(path)


def test_shape_mismatch_names_the_tensor_and_the_path(checkpoints, megatron_world):
    """A config saying hidden_size=32 beside weights of hidden size 64."""
    from rlfw.megatron.model import build_gpt, transformer_config

    path = checkpoints["llama"]
    shape = ModelShape(**{**architecture(read_hf_config(path)), "hidden_size": 32, "head_dim": 8}, max_seq_len=64)
    model = build_gpt(shape, transformer_config(shape))
    with pytest.raises(ValueError, match=rf"{path}.*'model.embed_tokens.weight' has shape \(48, 64\), "
                                         r"expected \(48, 32\)"):
        load_hf_weights(path, shape, model)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (lambda: LlamaConfig(**COMMON, attention_bias=True), "attention_bias"),
        (lambda: LlamaConfig(**{**COMMON, "hidden_act": "gelu"}), "hidden_act"),
        (lambda: LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
         "rope_type 'linear'"),
        (lambda: LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 4096}), "llama3 RoPE bands"),
        (lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=0),
         "use_sliding_window"),
    ],
)
def test_unsupported_settings_are_named(config, named, tmp_path):
    config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=named):
        architecture(read_hf_config(tmp_path))


def test_unsupported_architecture_names_its_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        read_hf_config(tmp_path)


# ------------------------------------------------------------------------------------------------ the config
def compose_model(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_model_hf_fills_the_architecture_from_the_checkpoint(checkpoints):
    cfg = compose_model("model=hf", f"model.hf_path={checkpoints['qwen3']}", "model.max_seq_len=96")
    fill_model_config(cfg.model)
    assert {key: cfg.model[key] for key in {**SHAPE_KEYS, **ARCHITECTURES["qwen3"]}} == {
        **SHAPE_KEYS, **ARCHITECTURES["qwen3"]
    }
    assert cfg.model.max_seq_len == 96  # the training context is the run's, not the checkpoint's


def test_config_errors_name_the_key(checkpoints, tmp_path):
    from rlfw.config import validate

    cfg = compose_model("model=hf", f"model.hf_path={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="model.hf_path=.*nowhere.*does not exist"):
        fill_model_config(cfg.model)
    with pytest.raises(ConfigError, match="model.hf_path=.*nowhere.*is not a directory"):
        validate(cfg)
    with pytest.raises(ConfigError, match="model.num_layers is not set and model.hf_path names no checkpoint"):
        validate(compose_model("model=hf"))
    # A given key that contradicts the checkpoint: the weights could not load into the model it describes.
    cfg = compose_model("model=hf", f"model.hf_path={checkpoints['qwen2']}", "model.hidden_size=128")
    with pytest.raises(ConfigError, match=r"model.hidden_size=128 but the checkpoint .*qwen2.* has 64"):
        fill_model_config(cfg.model)
    cfg = compose_model("model=tiny", f"model.hf_path={checkpoints['llama']}")
    with pytest.raises(ConfigError, match="model.num_layers=2 but|model.hidden_size=128 but"):
        fill_model_config(cfg.model)
    with pytest.raises(ConfigError, match="model.vocab_size=50 is not divisible by dp.tp=4"):
        validate(compose_model("model.vocab_size=50", "dp.tp=4", "model.num_attention_heads=4",
                               "model.num_query_groups=4"))
    with pytest.raises(ConfigError, match="model.qkv_bias and model.qk_layernorm"):
        validate(compose_model("model.qkv_bias=true", "model.qk_layernorm=true"))


def test_tasks_get_the_checkpoint_tokenizer_through_a_target_node(checkpoints):
    """The word-level tokenizer saved beside a Qwen2 config comes back as saved (AutoTokenizer alone would
    rebuild it as a byte-level BPE Qwen2Tokenizer, which splits these words differently)."""
    node = {"_target_": "rlfw.model.hf_checkpoint.load_tokenizer", "path": str(checkpoints["qwen2"])}
    tokenizer = instantiate(node)
    assert len(tokenizer) == 12 and tokenizer.eos_token_id == 2
    assert tokenizer.encode("<bos> w0 w7 =") == [1, 4, 11, 3]


def test_local_engine_serves_the_family(checkpoints, megatron_world):
    """The rollout engine builds the checkpoint's HF class and, loaded with the export, reports the log-probs the
    trainer computes."""
    from rlfw.rollout.engines.local import LocalEngine
    from rlfw.rollout.types import SamplingParams

    for name, path in checkpoints.items():
        shape = shape_of(path)
        model = imported_gpt(path)
        engine = LocalEngine(shape, eos_token_id=2, pad_token_id=0, seed=0)
        assert type(engine.model).__name__ == type(AutoModelForCausalLM.from_config(HF_CONFIGS[name]())).__name__
        engine.update_weights(megatron_to_hf(model.state_dict(), shape), version=0)
        prompt = [1, 5, 6, 3]
        (generation,) = engine.generate([prompt], SamplingParams(temperature=0, top_p=1.0, max_new_tokens=4))
        tokens = torch.tensor([prompt + generation.response_ids[:-1]])
        logprobs = torch.log_softmax(megatron_logits(model, tokens)[0], dim=-1)
        expected = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(generation.response_ids)]
        assert generation.logprobs == pytest.approx(expected, abs=1e-5), name
