"""The calc task: add two numbers too long to add in one's head, with a calculator tool.

The prompt is ``<bos> a1 .. aD + b1 .. bD =`` (two D-digit numbers). A good episode has two turns:

    calc a1 .. aD + b1 .. bD <eos>        the policy calls the tool with the operands
    -> s1 .. sK =                         the tool's answer (the sum, K = D or D + 1 digits)
    s1 .. sK <eos>                        the policy copies it as its final answer

A turn that starts with ``calc`` is a call (the compact syntax: ``rlfw.rollout.envs.tools.parse_compact``); any
other turn is the final answer and ends the episode. Why it is learnable from scratch by the tiny model, with
partial credit (as in the copy task): the call is a copy of the prompt's expression, and the answer a copy of the
tool's output, both at fixed offsets. Reward, in [0, 1]:

* ``CALL_WEIGHT`` for calling the tool, plus ``OPERANDS_WEIGHT`` x the fraction of the expression's tokens the
  first call copied at their position, when the call reached a tool (the environment has it): calling must pay from
  the first step on, or the policy settles on answering by itself before it ever learns to call;
* ``ANSWER_WEIGHT`` x the fraction of the sum's digits the final answer has at their position;
* ``STOP_WEIGHT`` when the final answer is exactly the sum's length and then ``<eos>``.

No number has a leading zero: a digit that is nearly always the same (a zero-padded sum's first) is an easy
reward for answering without the tool, which the policy then settles on.

Without the tool (``task.tools=[]``) a call is an error observation and earns nothing: the policy must add
D-digit numbers itself, which the tiny model does not learn in minutes (BENCHMARKS.md measures both).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast

from rlfw.rollout.envs.base import Done, Observation
from rlfw.rollout.envs.episode import Episode
from rlfw.rollout.envs.tool_env import ToolEnvironment
from rlfw.rollout.envs.tools import ToolCall, parse_compact
from rlfw.rollout.tokenizer import BOS, EOS, SEPARATOR, build_tokenizer
from rlfw.rollout.types import Prompt

CALL_WEIGHT, OPERANDS_WEIGHT, ANSWER_WEIGHT, STOP_WEIGHT = 0.1, 0.3, 0.5, 0.1
DIGITS = [str(d) for d in range(10)]
CALL, RESULT, ERROR = "calc", "->", "error"


class CalcEnv(ToolEnvironment):
    """Sums of two ``digits``-digit numbers; ``tools``: the calculator (``[]`` disables it)."""

    def __init__(self, tool_pool: Mapping[str, Any], digits: int = 2,
                 tools: Sequence[str] = ("rlfw.rollout.envs.builtin_tools.calc",), max_turns: int = 3,
                 seed: int = 0) -> None:
        super().__init__(tools, tool_pool, max_turns)
        if not 1 <= digits <= 6:
            raise ValueError(f"task.digits={digits} must be in [1, 6]")
        if set(self.tools) - {CALL}:
            raise ValueError(f"task.tools: the calc task knows only the tool named {CALL!r}, got {sorted(self.tools)}")
        self.digits = digits
        self._tokenizer = build_tokenizer([*DIGITS, "+", CALL, RESULT, ERROR])
        self._words = self._tokenizer.convert_ids_to_tokens(list(range(len(self._tokenizer))))
        self._ids = dict(zip(self._words, range(len(self._words))))
        self._eos = self._ids[EOS]
        self._rng = np.random.default_rng(seed)
        self._next_prompt_id = itertools.count()

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        return self._tokenizer

    @property
    def max_response_len(self) -> int:
        """A call: ``calc``, the 2D + 1 words of the expression, ``<eos>``."""
        return 2 * self.digits + 3

    def sample_prompts(self, n: int, rng: np.random.Generator | None = None) -> list[Prompt]:
        rng = self._rng if rng is None else rng
        prompts = []
        for a, b in rng.integers(10 ** (self.digits - 1), 10**self.digits, size=(n, 2)).tolist():
            prompts.append(Prompt(next(self._next_prompt_id), self._encode([BOS, *str(a), "+", *str(b), SEPARATOR]),
                                  self._encode([*str(a + b)])))
        return prompts

    def start(self, prompt: Prompt) -> dict[str, float]:
        return {"call": 0.0}

    def step(self, episode: Episode) -> Observation | Done:
        words = self._turn_words(episode.last_turn)
        if words and words[0] == CALL:
            call = parse_compact(words, self.tools) or ToolCall(CALL, error="the calculator is disabled")
            result = self.call_tool(episode, call)
            if CALL in self.tools and len(episode.tools) == 1:  # the first call that reached the tool earns credit
                expression = self._tokenizer.convert_ids_to_tokens(episode.prompt.token_ids[1:-1])
                episode.state["call"] = CALL_WEIGHT + OPERANDS_WEIGHT * _matched(words[1:], expression)
            answer = [*result.output] if result.error is None and result.output.isdigit() else [ERROR]
            return Observation(self._encode([RESULT, *answer, SEPARATOR]))
        target = self._tokenizer.convert_ids_to_tokens(episode.prompt.target)
        stops = len(words) == len(target) and episode.last_finish == "stop"
        return Done(self.cut_off(episode) + ANSWER_WEIGHT * _matched(words, target) + STOP_WEIGHT * stops)

    def cut_off(self, episode: Episode) -> float:
        return episode.state["call"]

    def _turn_words(self, ids: list[int]) -> list[str]:
        """The turn's words up to ``<eos>``; ids past the vocabulary (the embedding is padded) read as ``?``."""
        words = [self._words[i] if i < len(self._words) else "?" for i in ids]
        return words[:words.index(EOS)] if EOS in words else words

    def _encode(self, words: list[str]) -> list[int]:
        return [self._ids[w] for w in words]


def _matched(words: list[str], want: list[str]) -> float:
    return sum(a == b for a, b in zip(words, want)) / len(want)
