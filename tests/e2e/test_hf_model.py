"""Training starts from a Hugging Face checkpoint directory: ``model=hf model.hf_path=<dir>`` on the copy task.

The checkpoint is a tiny random Qwen2 (q/k/v biases, tied embeddings) built here with ``from_config`` and saved with
``save_pretrained``, with the copy task's tokenizer; its vocabulary is the task tokenizer's size padded to 16.
"""

import math

import pytest
import torch
from harness import final_model, read_jsonl, run_rlfw
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2Config

from rlfw.rollout.tasks.copy import CopyTask

pytestmark = pytest.mark.e2e

NUM_STEPS = 2
LR = 1e-4


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    tokenizer = CopyTask().tokenizer
    config = Qwen2Config(
        vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
    )
    assert len(tokenizer) <= config.vocab_size
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("qwen2")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_trains_from_an_hf_checkpoint(qwen2_dir, tmp_path):
    run_dir = run_rlfw(tmp_path / "run", "model=hf", f"model.hf_path={qwen2_dir}", f"num_steps={NUM_STEPS}",
                       f"algo.lr={LR}", "algo.weight_decay=0")

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    assert all(math.isfinite(r["loss"]) and r["rollout/num_samples"] == 64 for r in rows)
    # The engine (a Qwen2ForCausalLM built from the exported config) and the trainer agree on every log-prob.
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in rows)
    # The architecture read from config.json is what the run recorded.
    model = OmegaConf.load(run_dir / "config.yaml").model
    assert (model.hidden_size, model.num_layers, model.vocab_size, model.qkv_bias, model.tie_word_embeddings,
            model.rope_theta) == (64, 2, 16, True, True, 1e6)
    # Training started from the checkpoint's weights: Adam moves a weight by at most about lr per step (1.0013 lr
    # in the first two steps with betas 0.9/0.99), while a fresh random initialisation would differ by ~0.1.
    trained = next(v for k, v in final_model(run_dir).items() if k.endswith("embedding.word_embeddings.weight"))
    start = load_file(qwen2_dir / "model.safetensors")["model.embed_tokens.weight"]
    drift = float((trained - start).abs().max())
    assert 0 < drift <= 1.01 * NUM_STEPS * LR
