"""Load a reward function named by ``_target_`` and check, before any rollout, that it can be called."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from rlfw.errors import ConfigError

RewardFn = Callable[[str, str, str], float]


class RewardError(RuntimeError):
    """A reward function raised on a sample; the message names the sample and the function."""


@dataclass(frozen=True)
class Reward:
    """A reward function with its configured keyword arguments bound; ``target`` names it in errors."""

    target: str
    fn: RewardFn

    def __call__(self, prompt_text: str, response_text: str, answer: str) -> float:
        return self.fn(prompt_text, response_text, answer)


def load_reward(spec: Mapping[str, Any], key: str = "task.reward") -> Reward:
    """Import ``spec["_target_"]`` and bind the other keys of ``spec`` as keyword arguments.

    A target that does not import, is not callable, or cannot take ``(prompt_text, response_text, answer)`` plus
    the configured keywords is a ``ConfigError`` naming ``key``: it fails at start-up, not at the first rollout.
    """
    kwargs = OmegaConf.to_container(spec, resolve=True) if isinstance(spec, DictConfig) else dict(spec)
    target = kwargs.pop("_target_", None)
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{key} has no _target_: give {key}._target_=module.function")
    try:
        fn = get_object(target)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{key}._target_={target!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{key}._target_={target!r} is not callable")
    try:
        inspect.signature(fn).bind("prompt_text", "response_text", "answer", **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{key}._target_={target!r} cannot be called as fn(prompt_text, response_text, answer"
            f"{''.join(f', {k}=...' for k in kwargs)}): {e}"
        ) from None
    return Reward(target, functools.partial(fn, **kwargs))
