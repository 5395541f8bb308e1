"""The environment interface, and the adapter that makes a single-turn task a one-turn environment.

An episode starts from a ``Prompt``. The engine generates a turn (up to the end-of-sequence token or the turn's
token limit); the environment answers with an ``Observation`` (token ids appended to the episode as context: a
tool's output, a user's message) or ``Done``. The rollout manager asks again until the environment says done, the
episode reaches ``max_turns`` turns, or it fills the context (``model.max_seq_len``); an episode cut off by a limit
is flagged truncated and its last turn scored by ``cut_off``.

**Rewards per turn.** Each answer carries the reward of the turn it answers (an ``Observation``'s is 0 unless the
environment says otherwise); the episode's reward is the sum of its turns'. By default every policy token of an
episode is credited with that sum; with ``algo.turn_discount`` set, each turn's tokens are credited with the
discounted rewards from their own turn on (``rlfw.algo.advantages``): what lets a turn learn from what it controls
when a later turn's reward depends on other skills.

Environments answer from the manager's threads, several episodes at once, so ``step`` must be thread-safe: keep an
episode's own state in ``Episode.state`` (what ``start`` returns), not on the environment.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlfw.rollout.types import Prompt

if TYPE_CHECKING:
    import numpy as np

    from rlfw.rollout.envs.episode import Episode


@dataclass(frozen=True)
class Observation:
    """What the environment says back: token ids appended to the episode (tokenized once, never re-tokenized), and
    the reward of the turn it answers."""

    token_ids: list[int]
    reward: Any = 0.0


@dataclass(frozen=True)
class Done:
    """The episode is over; ``reward``: its last turn's (a real number; anything else is an error naming the
    environment). An environment that gives no reward with its observations gives the episode's here."""

    reward: Any


class Environment(abc.ABC):
    """A multi-turn environment; subclasses give prompts, answer turns and score episodes.

    ``max_response_len``: new tokens of one policy turn. ``max_turns``: policy turns of one episode.
    """

    max_turns: int = 1

    @property
    @abc.abstractmethod
    def tokenizer(self):
        """The tokenizer of prompts, turns and observations (the policy's vocabulary)."""

    @property
    @abc.abstractmethod
    def max_response_len(self) -> int:
        """New tokens of one policy turn."""

    @abc.abstractmethod
    def sample_prompts(self, n: int, step: int, rng: np.random.Generator) -> list[Prompt]:
        """``n`` episode starts of step ``step``, drawn with ``rng`` (the step's generator)."""

    def start(self, prompt: Prompt) -> Any:
        """A new episode's own state (``Episode.state``); None by default."""
        return None

    @abc.abstractmethod
    def step(self, episode: Episode) -> Observation | Done:
        """Answer the episode's last turn (``episode.last_turn``)."""

    def cut_off(self, episode: Episode) -> float:
        """The reward of the last turn of an episode a limit ended before the environment said done; 0 by default."""
        return 0.0

    def close(self) -> None:
        """Release what the environment started (tool workers); called when the rollout manager shuts down."""


class TaskPrompts:
    """An environment's prompts, tokenizer and turn length, taken from a single-turn task (``self.task``)."""

    task: Any

    @property
    def tokenizer(self):
        return self.task.tokenizer

    @property
    def max_response_len(self) -> int:
        return self.task.max_response_len

    def sample_prompts(self, n: int, step: int, rng) -> list[Prompt]:
        return self.task.sample_prompts(n, step, rng)


class OneTurn(TaskPrompts, Environment):
    """A single-turn task (``sample_prompts``, ``reward(prompt, response_ids)``, ``tokenizer``,
    ``max_response_len``) as a one-turn environment: the turn is the response, and its reward ends the episode."""

    def __init__(self, task) -> None:
        self.task = task

    def step(self, episode: Episode) -> Done:
        return Done(self.task.reward(episode.prompt, episode.last_turn))

    def close(self) -> None:
        getattr(self.task, "close", lambda: None)()


def as_environment(task) -> Environment:
    """``task`` itself when it is an environment, else the one-turn environment of the single-turn task."""
    return task if isinstance(task, Environment) else OneTurn(task)
