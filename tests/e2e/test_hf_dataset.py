"""A user's own model and data end to end: ``model=hf`` starts from a Hugging Face checkpoint directory and
``task=gsm8k`` reads prompts from a dataset file through the tokenizer's chat template, scored by math-verify.

The checkpoint is a tiny random Qwen2 (q/k/v biases, tied embeddings) built here with ``from_config`` and saved with
``save_pretrained`` beside a byte-level BPE tokenizer with a ChatML template, trained locally (600 tokens).
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from harness import final_model, read_jsonl, run_rlfw
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from chat_tokenizer import GSM8K_SAMPLE, build_chat_tokenizer

pytestmark = pytest.mark.e2e

NUM_STEPS = 2
LR = 1e-4


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    directory = build_chat_tokenizer(tmp_path_factory.mktemp("qwen2"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
    )
    assert config.vocab_size % 8 == 0
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_trains_from_an_hf_checkpoint_on_a_dataset_task(qwen2_dir, tmp_path):
    run_dir = run_rlfw(
        tmp_path / "run", "model=hf", f"model.hf_path={qwen2_dir}", "task=gsm8k", f"task.tokenizer_path={qwen2_dir}",
        "task.max_response_len=24", f"num_steps={NUM_STEPS}", "rollout.num_prompts=4", "model.max_seq_len=128",
        "algo.max_tokens_per_microbatch=512", f"algo.lr={LR}", "algo.weight_decay=0",
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))
    for row in rows:
        assert row["rollout/num_samples"] == 4 * 8  # every prompt fits and every reward is a number
        assert row["rollout/dropped_groups_nonfinite_reward"] == 0 == row["rollout/dropped_prompts_too_long"]
        assert 0.0 <= row["reward/mean"] <= 1.0 and math.isfinite(row["loss"])
        # The engine (a Qwen2ForCausalLM built from the exported config) and the trainer agree on every log-prob.
        assert row["rollout/logprob_abs_diff"] < 1e-4
    # The architecture read from config.json is what the run recorded.
    model = OmegaConf.load(run_dir / "config.yaml").model
    assert (model.hidden_size, model.num_layers, model.vocab_size, model.qkv_bias, model.tie_word_embeddings,
            model.rope_theta) == (64, 2, 600, True, True, 1e6)
    # Training started from the checkpoint's weights: Adam moves a weight by at most about lr per step (1.0013 lr
    # in the first two steps with betas 0.9/0.99), while a fresh random initialisation would differ by ~0.1.
    trained = next(v for k, v in final_model(run_dir).items() if k.endswith("embedding.word_embeddings.weight"))
    start = load_file(qwen2_dir / "model.safetensors")["model.embed_tokens.weight"]
    drift = float((trained - start).abs().max())
    assert 0 < drift <= 1.01 * NUM_STEPS * LR

    questions = [json.loads(line)["question"] for line in GSM8K_SAMPLE.read_text().splitlines()]
    examples = next(t["rows"] for t in read_jsonl(run_dir / "tables.jsonl") if t["name"] == "generations")
    for _sample_id, prompt_text, _response_text, reward in examples:
        assert prompt_text.startswith("<|im_start|>system\nSolve the problem step by step")
        assert prompt_text.endswith("<|im_start|>assistant\n")
        assert sum(question in prompt_text for question in questions) == 1
        assert reward in (0.0, 1.0)
    assert [len(entry["sample_ids"]) for entry in read_jsonl(run_dir / "ledger.jsonl")] == [32, 32]
