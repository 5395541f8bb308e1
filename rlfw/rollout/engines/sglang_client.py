"""HTTP client of one SGLang server (or router): the native API that RL needs, token ids in and out.

Request and response shapes follow SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py``, ``srt/managers/tokenizer_manager.py``, ``srt/managers/scheduler.py``,
``srt/managers/schedule_batch.py``, ``srt/layers/sampler.py``):

* ``POST /generate`` with ``{"input_ids": [[int]], "sampling_params": {...} or [{...}], "return_logprob": true}``
  answers one ``{"output_ids", "meta_info"}`` per input, in order. ``meta_info.output_token_logprobs`` is
  ``[[logprob, token_id, text-or-null], ...]`` for every generated token, the matched stop token included;
  ``meta_info.finish_reason`` is ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message": ...}``; ``meta_info.weight_version`` is the server's weight version when it
  answered. The log-probs are those of ``softmax(logits / temperature)`` before top-p (``log_softmax(logits)`` when
  greedy), the same distribution ``LocalEngine`` reports, unless the server runs with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB``. ``sampling_seed`` is honoured only with ``--enable-deterministic-inference``.
* ``POST /pause_generation`` with ``{"mode": "abort"}`` holds every new request until ``POST /continue_generation``
  (``{}``), aborts every request in flight and answers once none is left (``TokenizerManager.pause_generation``).
  An aborted ``/generate`` answers 200 like a finished one, with ``finish_reason`` ``{"type": "abort", ...}`` and
  the ``output_ids`` / ``output_token_logprobs`` sampled so far (a running request takes one more decode step, whose
  token it keeps, so its last token may be the stop token); a request aborted before its prefill has none
  (``"message": "Abort before prefill"``; older versions leave out ``output_token_logprobs`` there). Aborts that
  carry an HTTP ``status_code`` (bad input, overload) answer with that status instead.
* ``POST /update_weights_from_disk`` with ``{"model_path", "weight_version", "flush_cache"}`` answers
  ``{"success", "message", "num_paused_requests"}`` with status 200, or 400 when the load failed. It loads once no
  ``/generate`` is in flight (it takes ``model_update_lock`` as a writer, each ``/generate`` holds it as a reader),
  so tokens in flight are never sampled by two sets of weights.
* ``POST /update_weights_from_tensor`` with ``{"serialized_named_tensors": [one per TP rank], "weight_version",
  "flush_cache"}``, each entry base64 of ``ForkingPickler`` (``torch.multiprocessing``'s reductions) over a list of
  ``(name, tensor)``: the tensors' storages travel by handle, so the server must be on this node; answers
  ``{"success", "message"}`` (400 when the load failed). 0.5.23 takes it only between ``POST /begin_weight_update``
  and ``POST /end_weight_update`` (``{}`` each, answering the same way); 0.5.17 has neither (404).
* ``GET /health_generate`` is 200 once the server generated a token, 503 while it starts or is stuck (``/health``
  answers 200 without generating in 0.5.23, so it would call a wedged scheduler healthy).
* ``GET /model_info`` gives ``{"model_path", "weight_version", "is_generation", ...}`` (``/get_model_info`` is its
  deprecated alias).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import requests
import torch.multiprocessing

from rlfw.rollout.types import SamplingParams

CONNECT_TIMEOUT_S = 5.0


class ServerError(RuntimeError):
    """One server failed (down, timed out, aborted, stale weights, garbled answer); another one may not."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class RequestRejected(RuntimeError):
    """The server refused the request itself (HTTP 4xx); sending it elsewhere would not help."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


def request_seeds(seed: int, count: int) -> list[int]:
    """One sampling seed per request, derived from the call's seed and the request's position in the call.

    Identical prompts (the samples of one group) must not share a seed, or a deterministic server would return
    identical responses; a retried request keeps its position, hence its seed and its sample.
    """
    return [int(np.random.SeedSequence([seed, i]).generate_state(1)[0]) for i in range(count)]


def generate_payload(
    prompts: list[list[int]],
    params: SamplingParams,
    stop_token_ids: list[int],
    seeds: list[int] | None,
    max_new_tokens: list[int] | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body for a batch of token-id prompts (``seeds``: one per prompt, or None;
    ``max_new_tokens``: one budget per prompt, for continuations that have fewer tokens left, else
    ``params.max_new_tokens`` for all). One sampling dict serves the batch when every prompt has the same."""
    budgets = max_new_tokens or [params.max_new_tokens] * len(prompts)
    common = {"temperature": params.temperature, "top_p": params.top_p, "stop_token_ids": list(stop_token_ids)}
    sampling = [dict(common, max_new_tokens=budget) for budget in budgets]
    if seeds is not None:
        sampling = [dict(sp, sampling_seed=seed) for sp, seed in zip(sampling, seeds)]
    return {
        "input_ids": [list(prompt) for prompt in prompts],
        "sampling_params": sampling[0] if all(sp == sampling[0] for sp in sampling) else sampling,
        "return_logprob": True,
    }


@dataclass(frozen=True)
class Output:
    """One request's answer: the tokens it sampled and their log-probs, and how it ended: "stop", "length", or
    "abort" (stopped part-way by a pause or an abort: the tokens it has are good, the rest is missing)."""

    tokens: list[int]
    logprobs: list[float]
    finish: str
    message: str = ""


def parse_outputs(url: str, body: Any, count: int, expected_version: str) -> list[Output]:
    """The outputs in a ``/generate`` answer; ServerError if it is not ``count`` of them, each with tokens from
    weights ``expected_version`` (the decimal string of the version rlfw pushed: SGLang versions are strings)."""
    if not isinstance(body, list) or len(body) != count:
        got = f"{len(body)} items" if isinstance(body, list) else type(body).__name__
        raise ServerError(url, f"/generate answered {got} for {count} prompts")
    outputs = []
    for item in body:
        try:
            meta = item["meta_info"]
            finish = meta["finish_reason"] or {}
            reason = finish.get("type")
            # Aborted before its prefill, a request has no tokens, and older versions send no log-prob list.
            pairs = (meta.get("output_token_logprobs") or []) if reason == "abort" else meta["output_token_logprobs"]
            tokens = [int(pair[1]) for pair in pairs]
            logprobs = [float(pair[0]) for pair in pairs]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ServerError(url, f"/generate answer lacks {e!r}: {str(item)[:300]}") from None
        if reason not in ("stop", "length", "abort"):
            raise ServerError(url, f"unexpected finish_reason {finish!r}")
        if tokens and str(meta.get("weight_version")) != expected_version:
            raise ServerError(url, f"answered with weight version {meta.get('weight_version')!r}, "
                                   f"expected {expected_version!r}")
        if not tokens and reason != "abort":
            raise ServerError(url, "an answer without generated tokens")
        outputs.append(Output(tokens, logprobs, reason, str(finish.get("message") or "")))
    return outputs


class SGLangClient:
    """Calls to one server URL; every call has a timeout, and every failure is a ServerError or RequestRejected."""

    def __init__(self, url: str, request_timeout_s: float, control_timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_token_ids: list[int],
        expected_version: str,
        seeds: list[int] | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Output]:
        payload = generate_payload(prompts, params, stop_token_ids, seeds, max_new_tokens)
        body = self._call("POST", "/generate", self.request_timeout_s, json=payload)
        return parse_outputs(self.url, body, len(prompts), expected_version)

    def pause_generation(self) -> None:
        """Abort the requests in flight (each answers with its tokens so far) and hold new ones until
        ``continue_generation``; returns once none is in flight."""
        self._call("POST", "/pause_generation", self.control_timeout_s, json={"mode": "abort"})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", self.control_timeout_s, json={})

    def update_weights_from_disk(self, model_path: str, version: str, timeout_s: float) -> None:
        """Load the HF checkpoint at ``model_path`` (as the server sees the filesystem) and tag it ``version``."""
        body = self._call(
            "POST",
            "/update_weights_from_disk",
            timeout_s,
            json={"model_path": model_path, "weight_version": version, "flush_cache": True},
        )
        if not isinstance(body, dict) or body.get("success") is not True:
            raise RequestRejected(f"{self.url}/update_weights_from_disk failed: {body}")

    @staticmethod
    def shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of ``state`` in one shared-memory buffer (one file for the server to map, one copy here; moving
        each tensor's storage there instead costs a file and a round trip to torch's shared-memory manager each)."""
        # By file name, not by file descriptor: passing a descriptor needs a connection back to this process that
        # only its own children may open, and the server is no child of ours.
        torch.multiprocessing.set_sharing_strategy("file_system")
        offsets, total = {}, 0
        for name, tensor in state.items():
            offsets[name] = total
            total += -(-tensor.numel() * tensor.element_size() // 64) * 64  # each view 64-byte aligned
        buffer = torch.empty(total, dtype=torch.uint8).share_memory_()
        views = {}
        for name, tensor in state.items():
            size = tensor.numel() * tensor.element_size()
            view = buffer[offsets[name]:offsets[name] + size].view(tensor.dtype).view(tensor.shape)
            views[name] = view.copy_(tensor)
        return views

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], version: str, tp_size: int,
                                   timeout_s: float) -> None:
        """Load ``named_tensors`` (HF names) and tag them ``version``, without the disk: each storage goes by handle
        (a CPU tensor by the name of its shared-memory file, a CUDA tensor by its IPC handle), the same list to
        every tensor-parallel rank (``shared`` makes CPU ones cheap to send). The tensors must stay alive until this
        returns (the server has copied them)."""
        torch.multiprocessing.set_sharing_strategy("file_system")  # see ``shared``
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(named_tensors)
        serialized = base64.b64encode(buffer.getvalue()).decode()
        try:  # SGLang 0.5.23 loads tensors only inside a weight-update session; 0.5.17 has none (404)
            self._checked("/begin_weight_update", timeout_s, {})
            session = True
        except RequestRejected as e:
            if e.status_code != 404:
                raise
            session = False
        self._checked("/update_weights_from_tensor", timeout_s,
                      {"serialized_named_tensors": [serialized] * tp_size, "weight_version": version,
                       "flush_cache": True})
        if session:
            self._checked("/end_weight_update", timeout_s, {})

    def _checked(self, path: str, timeout_s: float, json: Any) -> None:
        """POST ``json`` to ``path``, which answers ``{"success", "message"}``; RequestRejected unless a success."""
        body = self._call("POST", path, timeout_s, json=json)
        if not isinstance(body, dict) or body.get("success") is not True:
            raise RequestRejected(f"{self.url}{path} failed: {body}")

    def model_info(self) -> dict[str, Any]:
        body = self._call("GET", "/model_info", self.control_timeout_s)
        if not isinstance(body, dict):
            raise ServerError(self.url, f"/model_info answered {str(body)[:200]}")
        return body

    def health_error(self, timeout_s: float | None = None) -> str | None:
        """None when ``/health_generate`` answers 200; else what went wrong."""
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        try:
            response = requests.get(self.url + "/health_generate", timeout=(CONNECT_TIMEOUT_S, timeout_s))
        except requests.RequestException as e:
            return f"{type(e).__name__}: {e}"
        return None if response.status_code == 200 else f"/health_generate answered HTTP {response.status_code}"

    def _call(self, method: str, path: str, timeout_s: float, json: Any = None) -> Any:
        try:
            response = requests.request(method, self.url + path, json=json, timeout=(CONNECT_TIMEOUT_S, timeout_s))
        except requests.Timeout:
            raise ServerError(self.url, f"{path} did not answer within {timeout_s}s") from None
        except requests.RequestException as e:
            raise ServerError(self.url, f"{path} failed: {type(e).__name__}: {e}") from None
        # 408 and 429 are a busy server or router (queue timeout, queue full), not a bad request.
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            raise RequestRejected(f"{self.url}{path} rejected the request (HTTP {response.status_code}): "
                                  f"{response.text[:500]}", response.status_code)
        if response.status_code != 200:
            raise ServerError(self.url, f"{path} answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            return response.json()
        except ValueError:
            raise ServerError(self.url, f"{path} answered non-JSON: {response.text[:200]}") from None
