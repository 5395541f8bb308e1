"""The calc task: subtract two numbers too long to subtract in one's head, with a calculator tool.

The prompt is ``<bos> a1 .. aD - b1 .. bD =`` (two D-digit numbers, a >= b, zero-padded). A good episode has
two turns:

    calc a1 .. aD - b1 .. bD <eos>        the policy calls the tool with the operands
    -> d1 .. dD =                         the tool's answer (the difference, zero-padded to D digits)
    d1 .. dD <eos>                        the policy copies it as its final answer

A turn that starts with ``calc`` is a call (the compact syntax: ``rlfw.rollout.envs.tools.parse_compact``); any
other turn is the final answer and ends the episode. Why it is learnable from scratch by the tiny model, with
partial credit (as in the copy task): the call is a copy of the prompt's expression, and the answer a copy of the
tool's output, both at fixed offsets. Reward, in [0, 1]:

* ``CALL_WEIGHT`` for calling the tool, plus ``OPERANDS_WEIGHT`` x the fraction of the expression's tokens, and
  the ``<eos>`` after them, that the first call has at their position, when the call reached a tool (the
  environment has it): calling must pay from the first step on, or the policy settles on answering by itself
  before it ever learns to call;
* ``ANSWER_WEIGHT`` x the fraction of the difference's D digits the final answer has at their position;
* ``STOP_WEIGHT`` when the final answer is exactly D words and then ``<eos>``.

Why a difference: every digit of the prompt, the call and the answer is close to uniform. A digit that is nearly
always the same (a sum's carry, "1" half the time) is an easy reward for answering without the tool; the policy
then writes that digit everywhere and stops exploring before it learns to copy.

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

CALL_WEIGHT, OPERANDS_WEIGHT, ANSWER_WEIGHT, STOP_WEIGHT = 0.1, 0.5, 0.3, 0.1
DIGITS = [str(d) for d in range(10)]
CALL, RESULT, ERROR = "calc", "->", "error"


class CalcEnv(ToolEnvironment):
    """Differences of two ``digits``-digit numbers; ``tools``: the calculator (``[]`` disables it)."""

    def __init__(self, tool_pool: Mapping[str, Any], digits: int = 2,
                 tools: Sequence[str] = ("rlfw.rollout.envs.builtin_tools.calc",), max_turns: int = 2,
                 seed: int = 0) -> None:
        super().__init__(tools, tool_pool, max_turns)
        if not 1 <= digits <= 6:
            raise ValueError(f"task.digits={digits} must be in [1, 6]")
        if set(self.tools) - {CALL}:
            raise ValueError(f"task.tools: the calc task knows only the tool named {CALL!r}, got {sorted(self.tools)}")
        self.digits = digits
        self._tokenizer = build_tokenizer([*DIGITS, "-", CALL, RESULT, ERROR])
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

    def sample_prompts(self, n: int, step: int = 0, rng: np.random.Generator | None = None) -> list[Prompt]:
        """``n`` fresh prompts drawn with ``rng`` (the step's), or with the environment's own generator."""
        rng = self._rng if rng is None else rng
        prompts = []
        for a, b in np.sort(rng.integers(0, 10**self.digits, size=(n, 2)), axis=1)[:, ::-1].tolist():
            expression = [*self._padded(a), "-", *self._padded(b)]
            prompts.append(Prompt(next(self._next_prompt_id), self._encode([BOS, *expression, SEPARATOR]),
                                  self._encode(self._padded(a - b))))
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
                call_words = self._words_of(episode.last_turn)[1:]  # with its <eos>
                episode.state["call"] = CALL_WEIGHT + OPERANDS_WEIGHT * _matched(call_words, [*expression, EOS])
            ok = result.error is None and result.output.isdigit()  # a negative difference has no word
            answer = self._padded(int(result.output)) if ok else [ERROR]
            return Observation(self._encode([RESULT, *answer, SEPARATOR]))
        target = self._tokenizer.convert_ids_to_tokens(episode.prompt.target)
        stops = len(words) == len(target) and episode.last_finish == "stop"
        return Done(self.cut_off(episode) + ANSWER_WEIGHT * _matched(words, target) + STOP_WEIGHT * stops)

    def cut_off(self, episode: Episode) -> float:
        return episode.state["call"]

    def _turn_words(self, ids: list[int]) -> list[str]:
        """The turn's words up to ``<eos>``."""
        words = self._words_of(ids)
        return words[:words.index(EOS)] if EOS in words else words

    def _words_of(self, ids: list[int]) -> list[str]:
        """Ids past the vocabulary (the embedding is padded) read as ``?``."""
        return [self._words[i] if i < len(self._words) else "?" for i in ids]

    def _padded(self, number: int) -> list[str]:
        return [*f"{number:0{self.digits}d}"]

    def _encode(self, words: list[str]) -> list[int]:
        return [self._ids[w] for w in words]


def _matched(words: list[str], want: list[str]) -> float:
    return sum(a == b for a, b in zip(words, want)) / len(want)
