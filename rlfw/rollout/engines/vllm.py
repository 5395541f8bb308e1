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
* **Partial rollouts.** The actor takes a weight push beside a generate call (``WeightHandoff``): between two
  engine steps the call aborts its requests in flight, keeps the tokens and log-probs each sampled so far, loads
  the weights, and adds every unfinished one again as a new request whose prompt is its prompt plus those tokens,
  for the tokens it has left, with its own seed. Each token records its version.
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

from rlfw.model.hf_checkpoint import save_hf_checkpoint
from rlfw.model.shape import ModelShape
from rlfw.cluster.address import interface_of, resolve
from rlfw.rollout.engines.base import Engine
from rlfw.rollout.engines.handoff import WeightHandoff
from rlfw.rollout.types import Generation, PartialResponse, SamplingParams


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

    supports_partial_rollout = True

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
        self._handoff = WeightHandoff()  # weights pushed during a generate call wait for its next engine step

    @classmethod
    def init_kwargs(cls, cfg, shape: ModelShape, tokenizer, seed: int, index: int, workdir: Path) -> dict[str, Any]:
        return {"shape": shape, "tokenizer": tokenizer, "seed": seed, "workdir": str(workdir),
                "host": cfg.cluster.host, "joined": bool(cfg.cluster.address), "kv_cache_gb": cfg.rollout.kv_cache_gb}

    def update_weights(self, hf_state: dict[str, Tensor], version: int) -> None:
        def apply() -> None:
            if self._llm is None:
                model_dir = self.workdir / "model"
                shutil.rmtree(model_dir, ignore_errors=True)  # this engine's own scratch copy, from an earlier start
                self._start(save_hf_checkpoint(model_dir, hf_state, self.shape, self.tokenizer))
            else:
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(hf_state.items())})
            self._set_version(version)

        self._handoff.load(apply, f"weights v{version}")

    def update_weights_from_dir(self, path: str, version: int) -> None:
        def apply() -> None:
            if self._llm is None:
                self._start(Path(path))
            else:
                self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            self._set_version(version)

        self._handoff.load(apply, f"weights v{version} from {path}")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One response per prompt. Weights pushed during the call (a partial rollout) are taken between two engine
        steps: the requests in flight are aborted, the weights reloaded, and each request goes on as a new one whose
        prompt is its prompt and the tokens sampled so far, for the tokens it has left."""
        self._require_weights()
        if not prompts:
            return []
        from vllm import SamplingParams as VLLMSamplingParams

        sampling = [
            VLLMSamplingParams(
                temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens, logprobs=0,
                detokenize=False, seed=int(seed),
            )
            for seed in self._seeds(params).integers(0, 2**31, size=len(prompts))
        ]
        started = time.perf_counter()
        requests = [_Request(f"{self._calls}-{i}", list(p), s) for i, (p, s) in enumerate(zip(prompts, sampling))]
        self._calls += 1
        with self._handoff.generating():
            running = {self._submit(r): r for r in requests}
            latest: dict[str, Any] = {}  # each running request's newest output (cumulative)
            while running:
                if self._handoff.take(before=lambda: self._interrupt(running, latest)):
                    running = {self._submit(r): r for r in running.values() if not r.finish(started)}
                    latest.clear()
                    continue
                for output in self._step():
                    latest[output.request_id] = output
                    if output.finished:
                        request = running.pop(output.request_id)
                        request.extend(output, self.weight_version)
                        request.finish(started, output.outputs[0].finish_reason)
        return [r.generation() for r in requests]

    def _step(self) -> list:
        """One vLLM engine step: the outputs of the requests that sampled a token."""
        return self._llm.llm_engine.step()

    def _submit(self, request: "_Request") -> str:
        """Add ``request`` (its prompt and the tokens it has so far, for what it has left) to vLLM: its new id."""
        from vllm.inputs import TokensPrompt

        request_id = f"{request.request_id}/{request.parts}"
        request.parts += 1
        params = request.params.clone()
        params.max_tokens -= len(request.tokens)
        if request.parts > 1 and params.seed is not None:  # a continuation: fresh draws, not the first tokens' again
            params.seed = int(np.random.SeedSequence([params.seed, len(request.tokens)]).generate_state(1)[0] >> 1)
        self._llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=request.prompt + request.tokens),
                                         params)
        return request_id

    def _interrupt(self, running: dict[str, "_Request"], latest: dict[str, Any]) -> None:
        """Abort the requests in flight, keeping what each sampled so far (under the weights now loaded)."""
        self._llm.llm_engine.abort_request(list(running))
        for request_id, request in running.items():
            if request_id in latest:
                request.extend(latest[request_id], self.weight_version)

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



class _Request(PartialResponse):
    """One sample across the vLLM requests it took: a continuation follows every weight change in flight."""

    def __init__(self, request_id: str, prompt: list[int], params) -> None:
        super().__init__()
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.parts = 0  # vLLM requests so far

    def extend(self, output, version: int) -> None:
        """Append what the vLLM request ``output`` sampled under ``version`` (its span labels must agree)."""
        [completion] = output.outputs
        tokens = list(completion.token_ids)
        spans = {int(span.version) for span in completion.weight_versions or []}
        # vLLM labels every span of tokens with the weights that sampled it: one request, one version.
        if spans and spans != {version}:
            raise RuntimeError(f"vLLM request {output.request_id} reports weights {sorted(spans)}, expected v{version}")
        self.add(tokens, [float(position[token].logprob) for position, token in zip(completion.logprobs, tokens)],
                 version)

    def finish(self, started: float, reason: str | None = None) -> bool:
        """Record the end (``reason``, or "length" when an interrupted request has no tokens left); returns whether
        the request is done."""
        if reason is None and len(self.tokens) < self.params.max_tokens:
            return False
        if (reason or "length") not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {self.request_id} with {reason!r}")
        self.finish_reason, self.seconds = reason or "length", time.perf_counter() - started
        return True
