"""A dataset task end to end: ``task=gsm8k`` with a locally built chat tokenizer and the tiny model.

(Named apart from tests/rollout/test_dataset_task.py: pytest imports test files by their base name.)
"""

import json
import math
import sys
from pathlib import Path

import pytest
from harness import read_jsonl, run_rlfw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from chat_tokenizer import GSM8K_SAMPLE, build_chat_tokenizer

pytestmark = pytest.mark.e2e


def test_gsm8k_task_trains_end_to_end(tmp_path):
    tokenizer_dir = build_chat_tokenizer(tmp_path / "tokenizer")
    run_dir = run_rlfw(
        tmp_path / "run", "task=gsm8k", f"task.tokenizer_path={tokenizer_dir}", "task.max_response_len=24",
        "num_steps=2", "rollout.num_prompts=4", "model.max_seq_len=128", "algo.max_tokens_per_microbatch=512",
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["rollout/num_samples"] == 4 * 8  # every prompt fits and every reward is a number
        assert row["rollout/dropped_groups_nonfinite_reward"] == 0 == row["rollout/dropped_prompts_too_long"]
        assert 0.0 <= row["reward/mean"] <= 1.0 and math.isfinite(row["loss"])
    questions = [json.loads(line)["question"] for line in GSM8K_SAMPLE.read_text().splitlines()]
    examples = next(t["rows"] for t in read_jsonl(run_dir / "tables.jsonl") if t["name"] == "generations")
    for _sample_id, prompt_text, _response_text, reward in examples:
        assert prompt_text.startswith("<|im_start|>system\nSolve the problem step by step")
        assert prompt_text.endswith("<|im_start|>assistant\n")
        assert sum(question in prompt_text for question in questions) == 1
        assert reward in (0.0, 1.0)
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [len(entry["sample_ids"]) for entry in ledger] == [32, 32]
