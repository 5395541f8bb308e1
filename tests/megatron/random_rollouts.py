"""Rollout batches of random tokens for the trainer's tests: varied prompt and response lengths, one advantage each."""

import random

from rlfw.data.batch import RolloutBatch


def random_rollout(vocab_size: int, count: int, seed: int, max_prompt: int, max_response: int,
                   group_size: int = 4) -> RolloutBatch:
    rng = random.Random(seed)
    cols = {k: [] for k in ("sample_id", "group_id", "tokens", "prompt_len", "advantage")}
    for i in range(count):
        p, r = rng.randint(1, max_prompt), rng.randint(1, max_response)
        cols["sample_id"].append(i)
        cols["group_id"].append(i // group_size)
        cols["tokens"].append([rng.randrange(vocab_size) for _ in range(p + r)])
        cols["prompt_len"].append(p)
        cols["advantage"].append(rng.gauss(0.0, 1.0))
    return RolloutBatch(cols, {"step": seed})
