"""Generation engines: turn prompts into sampled responses with per-token logprobs under given policy weights."""

from rlfw.rollout.engines.local import LocalEngine

__all__ = ["LocalEngine"]
