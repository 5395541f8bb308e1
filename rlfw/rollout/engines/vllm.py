"""VLLMEngine: vLLM's offline ``LLM`` inside the engine's own Ray actor (CPU: fp32, eager), fed token ids.

Choices, and why:

* **In-process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM's engine core, scheduler and model runner live in
  the actor's process. So ``collective_rpc`` reaches the model runner directly (weights are passed as tensors,
  not serialised through vLLM's message queue), and when the actor dies nothing is left behind: vLLM starts no
  process of its own. Its only listeners are the Gloo sockets of its single-rank process group (initialised
  through a file store), which follow ``GLOO_SOCKET_IFNAME``; ``VLLM_HOST_IP`` / ``VLLM_LOOPBACK_IP`` are set to
  ``cluster.host`` and usage reporting is off.
* **The first weights start the engine.** vLLM loads a model from a Hugging Face directory, so the first
  ``update_weights`` writes config, weights (safetensors) and tokenizer to ``workdir/model`` and builds the
  ``LLM`` there; later updates are loaded in place with the model runner's ``reload_weights``, the prefix cache is
  dropped (its keys and values belong to the old weights) and vLLM's own weight-version label is set, which it
  reports per generated token span: ``generate`` checks it.
* **One request per sample.** A group's samples are separate requests with the same prompt rather than one
  request with ``n``: prefix caching computes the shared prompt once anyway, and each sample gets its own
  finish time and seed, and can be retried alone on another engine.
* **Log-probs** are vLLM's ``processed_logprobs`` of the sampled token: ``log_softmax(logits / temperature)``
  like ``LocalEngine``, except that with ``top_p < 1`` vLLM renormalises over the nucleus first (the trainer does
  not model the truncation, so ``rollout/logprob_abs_diff`` grows with it). Greedy decoding reports
  ``log_softmax(logits)``.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from rlfw.megatron.hf_checkpoint import save_hf_checkpoint
from rlfw.megatron.model import ModelShape
from rlfw.cluster.address import interface_of, resolve
from rlfw.rollout.engines.base import Engine
from rlfw.rollout.types import Generation, SamplingParams


def vllm_environment(host: str) -> dict[str, str]:
    """Environment vLLM reads at import and start-up: in-process, offline, no usage reports, bound to ``host``."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_HOST_IP": host,
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    if host.startswith("127.") or host == "::1":
        env["VLLM_LOOPBACK_IP"] = host
    iface = interface_of(host)
    if iface:
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


class VLLMEngine(Engine):
    """Samples responses with vLLM from the policy last loaded with ``update_weights``."""

    def __init__(
        self, shape: ModelShape, tokenizer, seed: int, workdir: str, host: str = "auto", joined: bool = False,
        kv_cache_gb: float = 0.5,
    ) -> None:
        # ``host`` is the cluster.host rule, resolved on the node this engine runs on
        os.environ.update(vllm_environment(resolve(host, joined)))  # before vLLM is imported (in _start)
        self.shape = shape
        self.tokenizer = tokenizer
        self.workdir = Path(workdir)
        self.kv_cache_bytes = int(kv_cache_gb * (1 << 30))
        self.seed = seed
        self._request_seeds = np.random.default_rng(seed)
        self._calls = 0  # numbers the generate calls, so request ids stay unique
        self.weight_version: int | None = None
        self._llm = None

    @classmethod
    def init_kwargs(cls, cfg, shape: ModelShape, tokenizer, seed: int, workdir: Path) -> dict[str, Any]:
        return {"shape": shape, "tokenizer": tokenizer, "seed": seed, "workdir": str(workdir),
                "host": cfg.cluster.host, "joined": bool(cfg.cluster.address), "kv_cache_gb": cfg.rollout.kv_cache_gb}

    def update_weights(self, hf_state: dict[str, Tensor], version: int) -> None:
        if self._llm is None:
            model_dir = self.workdir / "model"
            shutil.rmtree(model_dir, ignore_errors=True)  # this engine's own scratch copy, from an earlier start
            self._start(save_hf_checkpoint(model_dir, hf_state, self.shape, self.tokenizer))
        else:
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(hf_state.items())})
        self._set_version(version)

    def update_weights_from_dir(self, path: str, version: int) -> None:
        if self._llm is None:
            self._start(Path(path))
        else:
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self._set_version(version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self._require_weights()
        if not prompts:
            return []
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        sampling = [
            VLLMSamplingParams(
                temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens, logprobs=0,
                detokenize=False, seed=int(seed),
            )
            for seed in self._seeds(params).integers(0, 2**31, size=len(prompts))
        ]
        engine = self._llm.llm_engine
        started = time.perf_counter()
        request_ids = [f"{self._calls}-{i}" for i in range(len(prompts))]
        self._calls += 1
        for request_id, prompt, request_params in zip(request_ids, prompts, sampling):
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), request_params)
        finished: dict[str, tuple[Any, float]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = (output, time.perf_counter() - started)
        return [self._generation(*finished[request_id]) for request_id in request_ids]

    def _seeds(self, params: SamplingParams) -> np.random.Generator:
        """Where the requests' seeds come from: the call's seed when it has one, else the engine's own stream."""
        return self._request_seeds if params.seed is None else np.random.default_rng(params.seed)

    def health(self) -> dict[str, Any]:
        return {**super().health(), "started": self._llm is not None}

    def shutdown(self) -> None:
        """Stop vLLM's engine core and tear down its process group, so the actor exits with nothing left open."""
        if self._llm is None:
            return
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()

    def _start(self, model_dir: Path) -> None:
        from vllm import LLM

        # vLLM's process-group rendezvous file goes to the temp dir: keep it in the run dir, where an engine that
        # was killed leaves it, rather than in /tmp (this process is the engine's alone).
        tempfile.tempdir = str(self.workdir / "tmp")
        Path(tempfile.tempdir).mkdir(parents=True, exist_ok=True)
        self._llm = LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=self.shape.max_seq_len,
            kv_cache_memory_bytes=self.kv_cache_bytes,
            logprobs_mode="processed_logprobs",
            seed=self.seed,
        )

    def _set_version(self, version: int) -> None:
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache (requests still running): it would serve stale keys")
        self._llm.llm_engine.set_weight_version(str(version))
        self.weight_version = version

    def _generation(self, output, seconds: float) -> Generation:
        [completion] = output.outputs
        tokens = list(completion.token_ids)
        logprobs = [float(position[token].logprob) for position, token in zip(completion.logprobs, tokens)]
        versions = {span.version for span in completion.weight_versions or []}
        # vLLM labels every span of tokens with the weights that sampled it; a mixed response is unusable.
        version = int(versions.pop()) if len(versions) == 1 else None
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {output.request_id} with {completion.finish_reason!r}")
        return Generation(tokens, logprobs, completion.finish_reason, version, seconds)
