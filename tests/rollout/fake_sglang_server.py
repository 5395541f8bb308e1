"""A stand-in SGLang server for what a real one cannot be made to do on demand: hold a request between decode steps.

The SGLang engine's tests run against a real SGLang server on CPU (``test_sglang_real_server.py``); they start this
program, which speaks SGLang 0.5.23's HTTP API backed by LocalEngine, where they need a push to land mid-generation
at a chosen token, a router, or a launch that fails on cue (a server that exits at start or never becomes healthy).
It takes the command-line flags rlfw passes to SGLang, answers the endpoints rlfw uses with SGLang's JSON shapes
(see ``rlfw.rollout.engines.sglang_client``), refuses fields SGLang would not know, and generates for real: the weights
come from the checkpoint directory on disk and the tokens and log-probs from ``LocalEngine``. A request with
``sampling_seed`` is sampled alone, seeded by it, as SGLang's deterministic mode does per request.

Pausing mirrors SGLang's (sgl-project/sglang, ``python/sglang/srt/managers/tokenizer_manager.py``:
``pause_generation``, ``continue_generation``, ``generate_request``, ``_handle_abort_req``, ``_wait_one_response``;
``srt/managers/scheduler.py``: ``abort_request``; ``srt/managers/schedule_batch.py``: ``FINISH_ABORT``;
``srt/managers/io_struct.py``: ``PauseGenerationReqInput``; ``srt/entrypoints/http_server.py``: the routes).
``/pause_generation`` with mode "abort" (the only mode implemented; "retract" and "in_place" are refused) makes
every ``/generate`` in flight stop for real at its next decode step and answer 200 with the tokens and log-probs it
sampled so far and ``finish_reason`` ``{"type": "abort", "message": "Aborted", ...}`` (a request of the batch not
started yet answers "Abort before prefill" with no tokens), answers once none is in flight, and holds new
``/generate`` requests until ``/continue_generation``. SGLang's running requests take one more decode step after an
abort and keep its token; this stand-in stops before it, which the client handles alike. As in SGLang, a weight load
waits for the generation in flight (its writer lock), so no answer mixes two sets of weights.

Flags starting with ``--fake-`` make it misbehave on purpose (never healthy, hang in one /generate, fork a child
like SGLang's scheduler), hold the first generation to reach N tokens until a pause aborts it (so that a test pushes
weights at a known point), or act as an SGLang router in front of other servers. ``--fake-events FILE`` appends one
JSON line per event (start, request, hold) so a test can see what reached the server.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# The GenerateReqInput and SamplingParams fields this stand-in implements; anything else is refused with 400 so a
# misspelt field fails the test instead of being silently ignored.
GENERATE_FIELDS = {"input_ids", "sampling_params", "return_logprob"}
SAMPLING_FIELDS = {"temperature", "top_p", "max_new_tokens", "stop_token_ids", "sampling_seed"}
UPDATE_FIELDS = {"model_path", "weight_version", "flush_cache", "load_format", "abort_all_requests"}
PAUSE_FIELDS = {"mode"}
WAIT_S = 300.0  # the longest this stand-in waits for anything (a pause to end, requests to stop, a test's pause)
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT().to_json()


CHILD = "import ctypes, signal, time; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); time.sleep(3600)"


class BadRequest(ValueError):
    pass


class Unavailable(RuntimeError):
    """Answered 503: something this stand-in waited for did not happen within ``WAIT_S``."""


class Stopped(Exception):
    """A pause aborted the generation under way: raised between two of its decode steps."""


class Model:
    """LocalEngine over a checkpoint directory, reloadable in place like SGLang's /update_weights_from_disk, whose
    generations a pause stops between two decode steps."""

    def __init__(
        self, path: str, weight_version: str, seed: int, hold_after: int | None,
        record: Callable[[dict[str, Any]], None],
    ) -> None:
        # Imported here: a router loads no model, so it skips torch and transformers and starts at once.
        import torch

        from rlfw.model.hf_checkpoint import read_hf_config

        torch.set_num_threads(1)
        self.shape = _shape(path)
        self.eos_token_id = read_hf_config(path).eos_token_id
        self.engine = _stepped_engine(self.shape, self.eos_token_id, seed)
        self.lock = threading.Lock()  # one generation or load at a time, as SGLang's scheduler runs one batch
        self.gate = threading.Condition()  # guards the three fields below
        self.paused = False
        self.in_flight = 0  # /generate calls past the pause gate and not answered yet
        self.pauses = 0  # a generation that began before the latest pause stops at its next decode step
        self.hold_after = hold_after  # the first generation waits before this many tokens for a pause to stop it
        self.record = record
        self.load(path, weight_version)

    def load(self, path: str, weight_version: str) -> None:
        from safetensors.torch import load_file

        with self.lock:
            if _shape(path) != self.shape:
                raise BadRequest(f"{path} holds another architecture than the running model")
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
        with self.gate:  # SGLang's generate_request: a request arriving while paused waits for the continue
            if not self.gate.wait_for(lambda: not self.paused, WAIT_S):
                raise Unavailable(f"still paused after {WAIT_S:g} s")
            self.in_flight += 1
            began = self.pauses
        try:
            with self.lock:
                version = self.weight_version
                if all(sp == per_request[0] and "sampling_seed" not in sp for sp in per_request):
                    outputs = self._run(prompts, _params(per_request[0]), began)
                else:  # deterministic per-request sampling: each request alone, seeded by its own sampling_seed
                    outputs = [self._run([p], _params(sp), began)[0] for p, sp in zip(prompts, per_request)]
        finally:
            with self.gate:
                self.in_flight -= 1
                self.gate.notify_all()
        out = [_answer(p, o, version, bool(body.get("return_logprob"))) for p, o in zip(prompts, outputs)]
        return out[0] if single else out

    def _run(self, prompts: list[list[int]], params, began: int) -> list[tuple | None]:
        """(tokens, log-probs, finish_reason) per prompt, generated together; None for each when a pause came
        before the generation began (SGLang's abort before prefill)."""
        if self.pauses != began:
            return [None] * len(prompts)
        steps: list[tuple[list[int], list[float]]] = []  # each decode step's tokens and log-probs, one per prompt

        def before_step() -> None:
            if len(steps) == self.hold_after:
                self.hold_after = None
                self._hold(began, len(steps))
            if self.pauses != began:
                raise Stopped

        self.engine.before_step, self.engine.steps = before_step, steps
        try:
            generations = self.engine.generate(prompts, params)
        except Stopped:
            return [self._so_far(steps, row) for row in range(len(prompts))]
        return [(g.response_ids, g.logprobs, _finish(g.response_ids, g.finish_reason)) for g in generations]

    def _hold(self, began: int, tokens: int) -> None:
        """Wait (``WAIT_S`` at most) for a pause to stop this generation: a test pushes weights at a known point."""
        self.record({"event": "held", "pid": os.getpid(), "tokens": tokens})
        with self.gate:
            self.gate.wait_for(lambda: self.pauses != began, WAIT_S)

    def _so_far(self, steps: list, row: int) -> tuple:
        """What row ``row`` sampled before the generation stopped: finished if it reached the stop token."""
        tokens, logprobs = [], []
        for step_tokens, step_logprobs in steps:
            tokens.append(step_tokens[row])
            logprobs.append(step_logprobs[row])
            if step_tokens[row] == self.eos_token_id:
                return tokens, logprobs, _finish(tokens, "stop")
        return tokens, logprobs, ABORTED

    def pause(self, body: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown("request", body, PAUSE_FIELDS)
        mode = body.get("mode", "abort")
        if mode != "abort":
            raise BadRequest(f"this stand-in implements pause mode 'abort' only, not {mode!r}")
        with self.gate:
            self.paused = True
            self.pauses += 1
            self.gate.notify_all()
            if not self.gate.wait_for(lambda: self.in_flight == 0, WAIT_S):
                raise Unavailable(f"{self.in_flight} requests still in flight {WAIT_S:g} s after the pause")
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict[str, Any]) -> dict[str, Any]:
        _refuse_unknown("request", body, set())
        with self.gate:
            self.paused = False
            self.gate.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

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


def _stepped_engine(shape, eos_token_id: int, seed: int):
    """A LocalEngine that calls ``before_step`` ahead of each decode step and appends what each step sampled to
    ``steps``, so a generation can stop between two steps and answer with the tokens so far."""
    from rlfw.rollout.engines.local import LocalEngine

    class SteppedEngine(LocalEngine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.before_step: Callable[[], None] = lambda: None
            self.steps: list[tuple[list[int], list[float]]] = []

        def _sample(self, logits, params):
            self.before_step()
            tokens, logprobs = super()._sample(logits, params)
            self.steps.append((tokens.tolist(), logprobs.tolist()))
            return tokens, logprobs

    return SteppedEngine(shape, eos_token_id=eos_token_id, pad_token_id=0, seed=seed)


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


def _finish(tokens: list[int], reason: str) -> dict[str, Any]:
    return {"type": "stop", "matched": tokens[-1]} if reason == "stop" else {"type": "length", "length": len(tokens)}


def _answer(prompt: list[int], output: tuple | None, version: str, return_logprob: bool) -> dict[str, Any]:
    request_id = f"fake-{next(_request_ids)}"
    if output is None:  # SGLang's TokenizerManager._handle_abort_req
        return {"output_ids": [], "meta_info": {
            "id": request_id, "finish_reason": {"type": "abort", "message": "Abort before prefill"},
            "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "weight_version": version}}
    tokens, logprobs, finish = output
    meta: dict[str, Any] = {
        "id": request_id,
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
            self._send(503 if self.server.args.fake_never_healthy else 200, None)
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
                if self.server.claim_hang():
                    self.server.record({"event": "hang", "pid": os.getpid()})
                    threading.Event().wait()  # until the test kills this process
                return self._send(200, self.server.model.generate(body))
            if self.path == "/update_weights_from_disk":
                return self._update(body)
            if self.path == "/pause_generation":
                return self._send(200, self.server.model.pause(body))
            if self.path == "/continue_generation":
                return self._send(200, self.server.model.resume(body))
        except (BadRequest, ValueError, KeyError, TypeError) as e:
            return self._send(400, {"error": {"message": f"{type(e).__name__}: {e}"}})
        except Unavailable as e:
            return self._send(503, {"error": {"message": str(e)}})
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
        self.model = None if self.routes_to else Model(args.model_path, args.weight_version, args.random_seed,
                                                       args.fake_hold_after, self.record)
        super().__init__((args.host, args.port), Handler)

    def claim_hang(self) -> bool:
        """Whether this request is the one to hang: the first to remove the --fake-hang-once file, of any server."""
        if not self.args.fake_hang_once:
            return False
        try:
            os.remove(self.args.fake_hang_once)
        except FileNotFoundError:
            return False
        return True

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
    parser.add_argument("--fake-never-healthy", action="store_true")
    parser.add_argument("--fake-hang-once", help="hang in /generate (until killed) if this file can be removed")
    parser.add_argument("--fake-spawn-child", action="store_true")
    parser.add_argument("--fake-hold-after", type=int,
                        help="hold the first generation to reach this many tokens until a pause stops it")
    parser.add_argument("--fake-router-for", help="comma-separated server URLs: act as a router in front of them")
    args = parser.parse_args()
    if not args.fake_router_for and not args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init is required: checkpoints written by rlfw carry no tokenizer")

    server = FakeServer(args)
    # SGLang forks a scheduler and a detokenizer, in its process group, which SIGKILL themselves when it dies.
    child = subprocess.Popen([sys.executable, "-c", CHILD]) if args.fake_spawn_child else None
    server.record({"event": "started", "pid": os.getpid(), "child_pid": child.pid if child else None,
                   "argv": sys.argv[1:]})
    print(f"fake sglang server listening on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
