"""A stand-in SGLang server for what a real one cannot be made to do here: act as a router, and sample exactly as
rlfw's local engine does.

The SGLang engine's tests run against a real SGLang server on CPU (``test_sglang_real_server.py``,
``test_sglang_real_launch.py``); ``test_sglang_engine.py`` starts this program where it needs an SGLang router (not
installed here: a Rust package of its own) or seeded sampling whose every token a test can predict (a real server
samples with its own kernels, so only its greedy tokens and its log-probs match the trainer's). It takes the
command-line flags rlfw passes to SGLang, answers ``/generate``, ``/update_weights_from_disk``, ``/health_generate``
and ``/model_info`` with SGLang 0.5.23's JSON shapes (see ``rlfw.rollout.engines.sglang_client``), refuses fields
SGLang would not know, and generates for real: the weights come from the checkpoint directory on disk and the tokens
and log-probs from ``LocalEngine``. A request with ``sampling_seed`` is sampled alone, seeded by it, as SGLang's
deterministic mode does per request. As in SGLang, a weight load waits for the generation in flight.

``--fake-router-for URLS`` makes it an SGLang router in front of those servers; ``--fake-events FILE`` appends one
JSON line per event (start, request) so a test can see what reached the server.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# The GenerateReqInput and SamplingParams fields this stand-in implements; anything else is refused with 400 so a
# misspelt field fails the test instead of being silently ignored.
GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob"}
SAMPLING_FIELDS = {"temperature", "top_p", "max_new_tokens", "stop_token_ids", "sampling_seed"}
UPDATE_FIELDS = {"model_path", "weight_version", "flush_cache", "load_format", "abort_all_requests"}


class BadRequest(ValueError):
    pass


class Model:
    """LocalEngine over a checkpoint directory, reloadable in place like SGLang's /update_weights_from_disk."""

    def __init__(self, path: str, weight_version: str, seed: int) -> None:
        # Imported here: a router loads no model, so it skips torch and transformers and starts at once.
        import torch

        from rlfw.model.hf_checkpoint import read_hf_config
        from rlfw.rollout.engines.local import LocalEngine

        torch.set_num_threads(1)
        self.shape = _shape(path)
        self.eos_token_id = read_hf_config(path).eos_token_id
        self.engine = LocalEngine(self.shape, eos_token_id=self.eos_token_id, pad_token_id=0, seed=seed)
        self.lock = threading.Lock()  # one generation or load at a time, as SGLang's scheduler runs one batch
        self.load(path, weight_version)

    def load(self, path: str, weight_version: str) -> None:
        from safetensors.torch import load_file

        with self.lock:
            self.engine.update_weights(load_file(str(Path(path) / "model.safetensors")), version=0)
            self.path, self.weight_version = path, weight_version

    def generate(self, body: dict[str, Any]) -> Any:
        _refuse_unknown("request", body, GENERATE_FIELDS)
        input_ids = body["input_ids"]
        single = bool(input_ids) and isinstance(input_ids[0], int)
        prompts = [input_ids] if single else input_ids
        sampling = body.get("sampling_params") or {}
        per_request = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(per_request) != len(prompts):
            raise BadRequest("sampling_params must be one dict or one per input")
        for sp in per_request:
            _refuse_unknown("sampling_params", sp, SAMPLING_FIELDS)
            if sp.get("stop_token_ids", [self.eos_token_id]) != [self.eos_token_id]:
                raise BadRequest(f"this stand-in stops only at eos {self.eos_token_id}: {sp['stop_token_ids']}")
        with self.lock:
            version = self.weight_version
            if all(sp == per_request[0] and "sampling_seed" not in sp for sp in per_request):
                generations = self.engine.generate(prompts, _params(per_request[0]))
            else:  # deterministic per-request sampling: each request alone, seeded by its own sampling_seed
                generations = [self.engine.generate([p], _params(sp))[0] for p, sp in zip(prompts, per_request)]
        out = [_answer(p, g, version, bool(body.get("return_logprob"))) for p, g in zip(prompts, generations)]
        return out[0] if single else out

    def info(self) -> dict[str, Any]:
        return {
            "model_path": self.path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }


def _shape(path: str):
    from rlfw.model.hf_checkpoint import architecture, read_hf_config
    from rlfw.model.shape import ModelShape

    config = read_hf_config(path)
    return ModelShape(**architecture(config), max_seq_len=config.max_position_embeddings)


def _refuse_unknown(what: str, body: dict[str, Any], known: set[str]) -> None:
    unknown = set(body) - known
    if unknown:
        raise BadRequest(f"{what} has fields this server does not implement: {sorted(unknown)}")


def _params(sp: dict[str, Any]):
    from rlfw.rollout.types import SamplingParams

    return SamplingParams(
        temperature=sp.get("temperature", 1.0),
        top_p=sp.get("top_p", 1.0),
        max_new_tokens=sp.get("max_new_tokens", 128),
        seed=sp.get("sampling_seed"),
    )


_request_ids = itertools.count()


def _answer(prompt: list[int], generation, version: str, return_logprob: bool) -> dict[str, Any]:
    tokens, logprobs = generation.response_ids, generation.logprobs
    finish = ({"type": "stop", "matched": tokens[-1]} if generation.finish_reason == "stop"
              else {"type": "length", "length": len(tokens)})
    meta: dict[str, Any] = {
        "id": f"fake-{next(_request_ids)}",
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "weight_version": version,
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
    }
    if return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens)]
        meta["output_token_logprobs_length"] = len(tokens)
    return {"output_ids": list(tokens), "meta_info": meta}


class Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def do_GET(self) -> None:
        self.server.record({"event": "request", "method": "GET", "path": self.path})
        if self.path in ("/health", "/health_generate"):
            self._send(200, None)
        elif self.path in ("/model_info", "/get_model_info") and self.server.model is not None:
            self._send(200, self.server.model.info())
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        self.server.record({"event": "request", "method": "POST", "path": self.path, "body": body})
        if self.server.routes_to:
            return self._forward(body)
        try:
            if self.path == "/generate":
                return self._send(200, self.server.model.generate(body))
            if self.path == "/update_weights_from_disk":
                return self._update(body)
        except (BadRequest, ValueError, KeyError, TypeError) as e:
            return self._send(400, {"error": {"message": f"{type(e).__name__}: {e}"}})
        self._send(404, {"detail": "Not Found"})

    def _update(self, body: dict[str, Any]) -> None:
        _refuse_unknown("request", body, UPDATE_FIELDS)
        version = body.get("weight_version")
        try:
            self.server.model.load(body["model_path"], version if version is not None else "default")
        except (OSError, BadRequest, RuntimeError) as e:
            return self._send(400, {"success": False, "message": str(e), "num_paused_requests": 0})
        self._send(200, {"success": True, "message": f"Succeeded. Weight version updated to {version}.",
                         "num_paused_requests": 0})

    def _forward(self, body: Any) -> None:
        """Router mode: hand the request to the next server, and its answer back."""
        target = next(self.server.routes_to) + self.path
        request = urllib.request.Request(target, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                self._send(response.status, json.loads(response.read()))
        except urllib.error.HTTPError as e:
            self._send(e.code, json.loads(e.read() or b"null"))
        except OSError as e:
            self._send(502, {"error": {"message": f"worker {target} failed: {e}"}})

    def _send(self, status: int, payload: Any) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        print(f"{self.address_string()} {format % args}", file=sys.stderr, flush=True)


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.events_lock = threading.Lock()
        self.routes_to = itertools.cycle(args.fake_router_for.split(",")) if args.fake_router_for else None
        self.model = None if self.routes_to else Model(args.model_path, args.weight_version, args.random_seed)
        super().__init__((args.host, args.port), Handler)

    def record(self, event: dict[str, Any]) -> None:
        if self.args.fake_events:
            with self.events_lock, open(self.args.fake_events, "a") as f:
                f.write(json.dumps({"port": self.args.port, **event}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # The flags rlfw passes to sglang.launch_server (SGLang 0.5.23 names).
    parser.add_argument("--model-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    # Test switches.
    parser.add_argument("--fake-events")
    parser.add_argument("--fake-router-for", help="comma-separated server URLs: act as a router in front of them")
    args = parser.parse_args()
    if not args.fake_router_for and not args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init is required: checkpoints written by rlfw carry no tokenizer")

    server = FakeServer(args)
    server.record({"event": "started", "pid": os.getpid(), "argv": sys.argv[1:]})
    print(f"fake sglang server listening on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
