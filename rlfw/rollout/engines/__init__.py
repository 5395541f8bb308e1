"""Generation engines: turn prompts into sampled responses with per-token logprobs under given policy weights."""

from rlfw.rollout.engines.base import ENGINES, Engine, build_engine, build_engines, engine_class
from rlfw.rollout.engines.local import LocalEngine

__all__ = ["ENGINES", "Engine", "LocalEngine", "build_engine", "build_engines", "engine_class"]
