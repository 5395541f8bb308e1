"""The calc task: add two numbers with a calculator tool (the tiny model cannot learn to add by itself in a run).

The prompt is ``<bos> a1 .. aD b1 .. bD =``: the digits of two D-digit numbers (zero-padded) whose sum is asked
for. A good episode has two turns:

    calc a1 .. aD b1 .. bD <eos>          the policy calls the tool with the operands
    -> s0 s1 .. sD =                      the tool's answer (a + b, zero-padded to D + 1 digits)
    s0 s1 .. sD <eos>                     the policy copies it as its final answer

A turn that starts with ``calc`` is a call, in the compact syntax (``rlfw.rollout.envs.tools.parse_compact``): its
argument is the 2D digits, which the environment hands the calculator as ``a + b``; a call with anything else is
an error observation. Any other turn is the final answer and ends the episode. Each turn earns for what it
controls (rewards per turn, ``rlfw.rollout.envs.base``), in all at most 1:

* the first call: ``OPERANDS_WEIGHT`` x the fraction of the 2D digits it has at their position (with the
  observation that answers it);
* the answer: ``ANSWER_WEIGHT`` x the fraction of the tool's D + 1 digits it copied at their position, plus
  ``STOP_WEIGHT`` when it is exactly D + 1 words and then ``<eos>``. Right operands and a right copy make the sum.

An answer after a call the tool could not answer (malformed, or no tool) earns nothing: it is a guess. An answer
without any call earns only as the whole sum and the stop (``ANSWER_WEIGHT + STOP_WEIGHT``): credit per digit there
paid for writing the sum's leading digit (0 or 1), which every policy settled on before it learned to call.

The design aims at a task the tiny model learns from scratch: the call is the copy task (the prompt's digits at
one fixed offset) and the answer another copy (the tool's digits), each with partial credit per position. Credited
with the episode's sum, the two turns spoil each other: the answer's reward is noise to the call (it depends on the
copy, not on the operands), and a token that is right at one position whatever the prompt (the padded sum's
leading digit) is an easy reward the policy then writes everywhere, in both turns, before it learns to copy
(BENCHMARKS.md). So ``conf/task/calc.yaml`` sets ``algo.turn_discount=0``: each turn is credited with its own reward,
against the same turn of the prompt's other episodes. No reward is paid for calling as such: it paid the first
calls' junk digits too. The operands' digits are uniform, and what follows them in a call is ignored (the turn ends
at its token limit).

Without the tool (``task.tools=[]``) a call is an error observation and earns nothing: the policy must add
D-digit numbers itself, and at most ``ANSWER_WEIGHT + STOP_WEIGHT`` (0.5) is reachable.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlfw.rollout.envs.base import Done, Observation
from rlfw.rollout.envs.episode import Episode
from rlfw.rollout.envs.tool_env import ToolEnvironment
from rlfw.rollout.envs.tools import ToolCall, parse_compact
from rlfw.rollout.tokenizer import BOS, EOS, SEPARATOR, WordTokenizer, build_tokenizer
from rlfw.rollout.types import Prompt

OPERANDS_WEIGHT, ANSWER_WEIGHT, STOP_WEIGHT = 0.5, 0.4, 0.1
DIGITS = [str(d) for d in range(10)]
CALL, RESULT, ERROR = "calc", "->", "error"


class CalcEnv(ToolEnvironment):
    """Sums of two ``digits``-digit numbers; ``tools``: the calculator (``[]`` disables it)."""

    def __init__(self, tool_pool: Mapping[str, Any], digits: int = 1,
                 tools: Sequence[str] = ("rlfw.rollout.envs.builtin_tools.calc",), max_turns: int = 2,
                 seed: int = 0) -> None:
        super().__init__(tools, tool_pool, max_turns)
        if not 1 <= digits <= 6:
            raise ValueError(f"task.digits={digits} must be in [1, 6]")
        if set(self.tools) - {CALL}:
            raise ValueError(f"task.tools: the calc task knows only the tool named {CALL!r}, got {sorted(self.tools)}")
        self.digits = digits
        self._tokenizer = build_tokenizer([*DIGITS, CALL, RESULT, ERROR])
        self._words = self._tokenizer.convert_ids_to_tokens(list(range(len(self._tokenizer))))
        self._ids = dict(zip(self._words, range(len(self._words))))
        self._rng = np.random.default_rng(seed)
        self._next_prompt_id = itertools.count()

    @property
    def tokenizer(self) -> WordTokenizer:
        return self._tokenizer

    @property
    def max_response_len(self) -> int:
        """A call: ``calc``, the 2D digits, ``<eos>``."""
        return 2 * self.digits + 2

    def sample_prompts(self, n: int, step: int = 0, rng: np.random.Generator | None = None) -> list[Prompt]:
        """``n`` fresh prompts drawn with ``rng`` (the step's), or with the environment's own generator."""
        rng = self._rng if rng is None else rng
        prompts = []
        for a, b in rng.integers(0, 10**self.digits, size=(n, 2)).tolist():
            operands = [*f"{a:0{self.digits}d}", *f"{b:0{self.digits}d}"]
            prompts.append(Prompt(next(self._next_prompt_id), self._encode([BOS, *operands, SEPARATOR]),
                                  self._encode(self._padded(a + b))))
        return prompts

    def start(self, prompt: Prompt) -> dict[str, Any]:
        return {"told": None}  # the tool's answer, once a call reached it

    def step(self, episode: Episode) -> Observation | Done:
        words = self._turn_words(episode.last_turn)
        if words and words[0] == CALL:
            first = not episode.tools
            result = self.call_tool(episode, self._call(words))
            answer = self._padded(int(result.output)) if result.error is None else None
            episode.state["told"] = answer
            operands = self._tokenizer.convert_ids_to_tokens(episode.prompt.token_ids[1:-1])
            earned = OPERANDS_WEIGHT * _matched(words[1:], operands) if first and CALL in self.tools else 0.0
            return Observation(self._encode([RESULT, *(answer or [ERROR]), SEPARATOR]), earned)
        if not episode.tools:  # answered without a call: the whole sum or nothing
            target = self._tokenizer.convert_ids_to_tokens(episode.prompt.target)
            return Done((ANSWER_WEIGHT + STOP_WEIGHT) * (words == target and episode.last_finish == "stop"))
        told = episode.state["told"]
        if told is None:  # the answer to a failed call is a guess: it earns nothing
            return Done(0.0)
        stops = len(words) == len(told) and episode.last_finish == "stop"
        return Done(ANSWER_WEIGHT * _matched(words, told) + STOP_WEIGHT * stops)

    def _call(self, words: list[str]) -> ToolCall:
        """``calc`` and the 2D digits of the operands (what follows them is ignored), as the calculator's
        ``a + b``."""
        call = parse_compact(words, self.tools)
        if call is None:
            return ToolCall(CALL, error="the calculator is disabled")
        digits = call.arguments["expression"].split()[:2 * self.digits]
        if len(digits) != 2 * self.digits or not all(d in DIGITS for d in digits):
            return ToolCall(CALL, error=f"a call is {CALL} and the {2 * self.digits} digits of the two operands")
        return ToolCall(CALL, {"expression": f"{''.join(digits[:self.digits])} + {''.join(digits[self.digits:])}"})

    def _turn_words(self, ids: list[int]) -> list[str]:
        """The turn's words up to ``<eos>``; ids past the vocabulary (the embedding is padded) read as ``?``."""
        words = [self._words[i] if i < len(self._words) else "?" for i in ids]
        return words[:words.index(EOS)] if EOS in words else words

    def _padded(self, number: int) -> list[str]:
        """D + 1 digits, zero-padded: the width of a sum of two D-digit numbers."""
        return [*f"{number:0{self.digits + 1}d}"]

    def _encode(self, words: list[str]) -> list[int]:
        return [self._ids[w] for w in words]


def _matched(words: list[str], want: list[str]) -> float:
    return sum(a == b for a, b in zip(words, want)) / len(want)
