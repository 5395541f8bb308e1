"""One episode, token in and token out: the ids from the prompt to the last turn, and what each token is.

The engine's tokens are kept exactly as sampled (never decoded and re-tokenized), with their log-probs and the
policy version that sampled each; the environment's tokens are appended as they were tokenized, once. The trainer
gets one sequence per episode: everything after the prompt is its "response", and ``loss_mask`` says which of
those tokens are the policy's (trained) and which the environment's (context only), ``token_turns`` which turn
each belongs to (an observation: the turn it answers), and ``turn_rewards`` what each turn earned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfw.rollout.types import Generation, Prompt


@dataclass(frozen=True)
class ToolRecord:
    """One tool call of an episode: the tool's name (or what the policy wrote for it), how long it took, and the
    error it became (None when the tool answered)."""

    name: str
    seconds: float
    error: str | None = None


@dataclass
class Episode:
    prompt: Prompt
    state: Any = None  # the environment's own (Environment.start)
    tokens: list[int] = field(default_factory=list)  # prompt + every turn and observation
    loss_mask: list[float] = field(default_factory=list)  # per token after the prompt: 1 policy, 0 environment
    logprobs: list[float] = field(default_factory=list)  # per token after the prompt (0 on the environment's)
    versions: list[int] = field(default_factory=list)  # the policy version of every policy token, in order
    token_turns: list[int] = field(default_factory=list)  # per token after the prompt: the turn it belongs to
    turn_rewards: list[float] = field(default_factory=list)  # per policy turn; the episode's reward is their sum
    turns: int = 0
    last_turn: list[int] = field(default_factory=list)
    last_finish: str | None = None  # the last turn's finish reason: "stop" or "length"
    partial: bool = False  # a turn sampled by more than one policy version (weights pushed inside it)
    seconds: float = 0.0  # engine seconds of its turns
    reward: float | None = None
    end: str | None = None  # done | turn_limit | token_limit
    tools: list[ToolRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt.token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def truncated(self) -> bool:
        """Ended by a limit, or its last turn ran out of tokens: flagged as a truncated sample is."""
        return self.end in ("turn_limit", "token_limit") or self.last_finish == "length"

    def add_turn(self, generation: Generation) -> None:
        ids = list(generation.response_ids)
        self.tokens += ids
        self.loss_mask += [1.0] * len(ids)
        self.token_turns += [self.turns] * len(ids)
        self.turn_rewards.append(0.0)
        self.logprobs += list(generation.logprobs)
        versions = generation.versions()
        self.versions += versions
        self.partial = self.partial or len(set(versions)) > 1
        self.turns += 1
        self.last_turn, self.last_finish = ids, generation.finish_reason
        self.seconds += generation.seconds

    def add_observation(self, token_ids: list[int]) -> None:
        self.tokens += token_ids
        self.loss_mask += [0.0] * len(token_ids)
        self.token_turns += [self.turns - 1] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    def credit(self, reward: float) -> None:
        """Add ``reward`` to the last turn's."""
        if not self.turn_rewards:  # ended before its first turn (no room left in the context)
            self.turn_rewards.append(0.0)
        self.turn_rewards[-1] += reward

    def finish(self, reward: float, end: str) -> None:
        """End the episode, ``reward`` its last turn's; its own reward is the sum of its turns'."""
        self.credit(reward)
        self.reward, self.end = sum(self.turn_rewards), end
