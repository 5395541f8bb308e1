"""The copy task: the built-in verifiable task used to check that RL training learns at all.

The prompt is ``<bos> s1 .. sL =`` with L random symbols, and the correct response repeats them and stops:
``s1 .. sL <eos>``. Why this task:

* It is verifiable exactly and cheaply, and small models learn it in few steps on CPU.
* Its reward is dense enough to learn from scratch: a random policy over the whole vocabulary already matches
  about 1/vocab of the positions, and one that only learned to emit symbols about 1/num_symbols.
* Scoring well needs the policy to condition on the prompt (the symbols are random), so a rising reward shows
  that credit reaches the attention to the prompt, not just the unconditional token frequencies.
"""

from __future__ import annotations

import itertools

import numpy as np

from rlfw.rollout.tokenizer import BOS, EOS, SEPARATOR, WordTokenizer, build_tokenizer
from rlfw.rollout.types import Prompt

# Share of the reward for ending with <eos> right after the copy: small, so that copying dominates, but enough
# to teach the policy to stop (finish_reason "stop") instead of running into the length limit.
EOS_WEIGHT = 0.1


class CopyTask:
    """Copy ``length`` random symbols out of ``num_symbols`` (named ``s0``, ``s1``, ...).

    With ``min_length`` set, each prompt draws its own length from a long-tailed (geometric) distribution between
    ``min_length`` and ``length``: the shape of real RL batches, where a few long samples dominate the work.
    """

    def __init__(self, num_symbols: int = 8, length: int = 3, seed: int = 0, min_length: int | None = None) -> None:
        if num_symbols < 1 or length < 1:
            raise ValueError(f"num_symbols and length must be >= 1, got {num_symbols} and {length}")
        if min_length is not None and not 1 <= min_length <= length:
            raise ValueError(f"min_length must be in [1, length={length}], got {min_length}")
        self.length = length
        self.min_length = min_length
        self._tokenizer = build_tokenizer([f"s{i}" for i in range(num_symbols)])
        self._symbol_ids = np.asarray(self._tokenizer.convert_tokens_to_ids([f"s{i}" for i in range(num_symbols)]))
        self._bos_id, self._separator_id, self._eos_id = self._tokenizer.convert_tokens_to_ids([BOS, SEPARATOR, EOS])
        self._rng = np.random.default_rng(seed)
        self._next_prompt_id = itertools.count()

    @property
    def tokenizer(self) -> WordTokenizer:
        return self._tokenizer

    @property
    def max_response_len(self) -> int:
        """The copy plus its ``<eos>``."""
        return self.length + 1

    def sample_prompts(self, n: int, step: int = 0, rng: np.random.Generator | None = None) -> list[Prompt]:
        """``n`` fresh prompts drawn with ``rng``, or with the task's own generator (seeded by ``seed``); they depend
        on ``step`` only through ``rng``, which the RolloutManager seeds per step."""
        rng = self._rng if rng is None else rng
        prompts = []
        for symbols in rng.choice(self._symbol_ids, size=(n, self.length)).tolist():
            if self.min_length is not None:
                symbols = symbols[: min(self.length, self.min_length + int(rng.geometric(0.15)) - 1)]
            prompts.append(
                Prompt(
                    prompt_id=next(self._next_prompt_id),
                    token_ids=[self._bos_id, *symbols, self._separator_id],
                    target=[*symbols, self._eos_id],
                )
            )
        return prompts

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """Partial credit in [0, 1]: ``1 - EOS_WEIGHT`` times the fraction of the L symbols copied at their position
        (positions the response does not reach score 0), plus ``EOS_WEIGHT`` if ``<eos>`` comes right after them.
        """
        symbols = prompt.target[:-1]
        length = len(symbols)
        copied = sum(answer == want for answer, want in zip(response_ids, symbols))
        stops = len(response_ids) > length and response_ids[length] == self._eos_id
        return (1 - EOS_WEIGHT) * copied / length + EOS_WEIGHT * stops
