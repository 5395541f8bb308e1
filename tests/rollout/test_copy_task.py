"""The copy task's prompts and its partial-credit reward."""

import numpy as np
import pytest

from rlfw.rollout.tasks import CopyTask
from rlfw.rollout.tasks.copy import EOS_WEIGHT
from rlfw.rollout.types import Prompt


def test_prompts_spell_out_the_copy():
    task = CopyTask(num_symbols=5, length=4)
    tokenizer = task.tokenizer
    prompts = task.sample_prompts(6, 0, np.random.default_rng(0))

    assert [p.prompt_id for p in prompts] == list(range(6))
    assert task.max_response_len == 5
    for prompt in prompts:
        symbols = tokenizer.convert_ids_to_tokens(prompt.target[:4])
        assert all(s in {"s0", "s1", "s2", "s3", "s4"} for s in symbols)
        assert tokenizer.decode(prompt.token_ids) == "<bos> " + " ".join(symbols) + " ="
        assert tokenizer.decode(prompt.target) == " ".join(symbols) + " <eos>"

    again = CopyTask(num_symbols=5, length=4).sample_prompts(6, 0, np.random.default_rng(0))
    assert [p.token_ids for p in again] == [p.token_ids for p in prompts]


def test_reward_gives_partial_credit():
    task = CopyTask(num_symbols=8, length=3)
    s1, s2, s3 = task.tokenizer.convert_tokens_to_ids(["s1", "s2", "s3"])
    eos = task.tokenizer.eos_token_id
    prompt = Prompt(prompt_id=0, token_ids=[1, s1, s2, s3, 3], target=[s1, s2, s3, eos])

    assert task.reward(prompt, [s1, s2, s3, eos]) == pytest.approx(1.0)
    assert task.reward(prompt, [s1, s2, s3]) == pytest.approx(1 - EOS_WEIGHT)  # ran out of length
    assert task.reward(prompt, [s1, s2, s3, s1]) == pytest.approx(1 - EOS_WEIGHT)
    assert task.reward(prompt, [s1, s3, s3, eos]) == pytest.approx((1 - EOS_WEIGHT) * 2 / 3 + EOS_WEIGHT)
    assert task.reward(prompt, [s1, eos]) == pytest.approx((1 - EOS_WEIGHT) / 3)  # missing positions score 0
    assert task.reward(prompt, [s3, s1, s2, s3]) == 0.0
    assert task.reward(prompt, []) == 0.0


def test_long_tailed_lengths_stay_in_range_and_score_by_their_own_length():
    import numpy as np

    from rlfw.rollout.tasks.copy import CopyTask

    task = CopyTask(num_symbols=8, length=20, min_length=2)
    prompts = task.sample_prompts(500, 0, np.random.default_rng(0))
    lengths = [len(p.target) - 1 for p in prompts]
    assert min(lengths) >= 2 and max(lengths) <= 20 and len(set(lengths)) > 5
    assert sorted(lengths)[len(lengths) // 2] < 10  # long tail: most are short
    short = next(p for p in prompts if len(p.target) - 1 == 2)
    assert task.reward(short, short.target) == 1.0
    assert task.reward(short, short.target[:1]) == (1 - 0.1) / 2
