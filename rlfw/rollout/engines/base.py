"""The interface every generation backend implements, and the factory that builds engines from the config.

An engine turns token-id prompts into sampled responses under the policy weights it was last given. Each one runs
as a Ray actor of its own (one call at a time), owned by the ``RolloutManager`` through an ``EnginePool``, which
spreads requests over the engines, retries those of an engine that died, and restarts it. A backend is a subclass
of ``Engine``:

* ``generate(prompts, params) -> list[Generation]``: one response per prompt, in order (repeat a prompt to sample
  it several times). ``Generation.logprobs`` are the log-probabilities of the sampled tokens under
  ``softmax(logits / temperature)`` (``softmax(logits)`` when greedy), the distribution the trainer recomputes;
  a backend that reports another one says so in its docstring. Every ``Generation`` carries the engine's
  ``weight_version`` at the time it was produced and its ``seconds``.
* ``update_weights(hf_state, version)``: load a full state dict with Hugging Face names (``rlfw.model.hf_convert
  .megatron_to_hf``) and record ``version``. ``update_weights_from_dir(path, version)`` does the same from a HF
  checkpoint directory, for backends that can read one.
* ``weight_version``: the version of the loaded weights, None before the first update; ``generate`` refuses to run
  without weights.
* ``supports_partial_rollout`` (class attribute): True when ``update_weights`` may run while ``generate`` is under
  way, and the responses in flight go on under the new weights (``Generation.token_versions`` records which tokens
  each version sampled; ``rlfw.rollout.engines.handoff`` hands the weights to the call). Such an engine's actor
  takes two calls at a time; every backend here does. An engine without it takes new weights between two
  ``generate`` calls: a push waits for the call under way.
* ``health() -> dict``: cheap liveness answer with at least ``weight_version`` and the process ``pid``.
* ``shutdown()``: release what the engine started (threads, processes, files) before its actor is killed.
* ``init_kwargs(cfg, shape, tokenizer, seed, index, workdir)`` (classmethod): the constructor arguments of engine
  ``index`` (its slot in the pool) for this run;
  ``num_actors(cfg)`` (classmethod): how many engine actors a run has (``rollout.num_engines`` by default).

``ENGINES`` maps ``rollout.backend`` to the class, by import path, so a backend's dependencies (vLLM, an HTTP
client) are imported only when it is selected. Registering a backend is one line there.
"""

from __future__ import annotations

import abc
import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlfw.cluster.labels import parse_labels
from rlfw.model.shape import ModelShape
from rlfw.rollout.types import Generation, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

# rollout.backend -> "module:Class" of its engine.
ENGINES = {
    "local": "rlfw.rollout.engines.local:LocalEngine",
    "vllm": "rlfw.rollout.engines.vllm:VLLMEngine",
    "sglang": "rlfw.rollout.engines.sglang:SGLangEngine",
}


class Engine(abc.ABC):
    """A generation backend; see the module docstring for the contract."""

    weight_version: int | None = None
    supports_partial_rollout: bool = False

    @classmethod
    @abc.abstractmethod
    def init_kwargs(cls, cfg, shape: ModelShape, tokenizer, seed: int, index: int, workdir: Path) -> dict[str, Any]:
        """Constructor arguments for engine ``index`` (sampling with ``seed``) of the run configured by ``cfg``
        (``workdir``: its files)."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One sampled response per prompt, in order."""

    @abc.abstractmethod
    def update_weights(self, hf_state: dict[str, Tensor], version: int) -> None:
        """Load full HF-named weights and record their version."""

    @classmethod
    def num_actors(cls, cfg) -> int:
        """Engine actors of a run; a backend whose one actor drives several servers itself returns 1."""
        return cfg.rollout.num_engines

    def update_weights_from_dir(self, path: str, version: int) -> None:
        """Load the weights of the HF checkpoint directory ``path`` and record their version."""
        raise NotImplementedError(f"{type(self).__name__} loads weights from tensors only")

    def health(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "pid": os.getpid()}

    def shutdown(self) -> None:
        """Nothing to release by default: the actor's death frees the memory."""

    def _require_weights(self) -> None:
        if self.weight_version is None:
            raise RuntimeError(f"{type(self).__name__}.generate called before update_weights: no policy weights yet")


def engine_class(backend: str) -> type[Engine]:
    if backend not in ENGINES:
        raise ValueError(f"rollout.backend={backend!r} has no engine; known: {sorted(ENGINES)}")
    module, _, name = ENGINES[backend].partition(":")
    return getattr(importlib.import_module(module), name)


def engine_seed(cfg, index: int, incarnation: int) -> int:
    """Distinct per engine and per restart, so a restarted engine does not replay its predecessor's samples."""
    return cfg.seed * 1000 + index + cfg.rollout.num_engines * incarnation


def engine_gpus(cfg) -> float:
    """Ray GPUs of one local engine: ``rollout.gpus_per_engine`` on CUDA with ``cluster.placement=separate``; none
    on CPU, or colocated, where the engine shares the trainers' GPUs by handing memory over between phases (Ray
    cannot account for that, and leaves an actor without GPUs every device of its node to see)."""
    if cfg.rollout.backend != "local" or cfg.cluster.placement == "colocated" or cfg.cluster.device == "cpu":
        return 0.0
    if cfg.cluster.device == "auto" and not ray.cluster_resources().get("GPU"):
        return 0.0
    return cfg.rollout.gpus_per_engine


def build_engine(cfg, shape: ModelShape, tokenizer, index: int, incarnation: int = 0):
    """Start engine ``index`` (its ``incarnation``-th start) as a Ray actor with ``rollout.cpus_per_engine`` CPUs
    (and ``engine_gpus``); one that supports partial rollouts takes a weight update (or a health check) beside a
    generate call."""
    cls = engine_class(cfg.rollout.backend)
    workdir = Path(cfg.run_dir or ".") / "rollout" / f"engine_{index}"
    kwargs = cls.init_kwargs(cfg, shape, tokenizer, engine_seed(cfg, index, incarnation), index, workdir)
    selector = parse_labels(cfg.rollout.engine_label_selector) or None
    return ray.remote(cls).options(num_cpus=cfg.rollout.cpus_per_engine, num_gpus=engine_gpus(cfg),
                                   label_selector=selector,
                                   max_concurrency=2 if cls.supports_partial_rollout else 1).remote(**kwargs)


def build_engines(cfg, shape: ModelShape, tokenizer) -> list:
    """The engine actors of backend ``rollout.backend`` (``rollout.num_engines`` of them, unless it says else)."""
    count = engine_class(cfg.rollout.backend).num_actors(cfg)
    return [build_engine(cfg, shape, tokenizer, i) for i in range(count)]
