"""Generation engines: turn prompts into sampled responses with per-token logprobs under given policy weights.

``LocalEngine`` is imported on first use: it imports transformers, which the driver and the rollout manager (who
only name engines) need not pay for at start-up."""

from rlfw.rollout.engines.base import ENGINES, Engine, build_engine, build_engines, engine_class

__all__ = ["ENGINES", "Engine", "LocalEngine", "build_engine", "build_engines", "engine_class"]


def __getattr__(name):
    if name == "LocalEngine":
        from rlfw.rollout.engines.local import LocalEngine

        return LocalEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
