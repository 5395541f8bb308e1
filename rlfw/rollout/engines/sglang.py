"""The SGLang engine: engine ``i`` of the run drives SGLang server ``i``, launched here or attached by URL.

It implements ``rlfw.rollout.engines.base.Engine`` over SGLang's HTTP API (``sglang_client``); the ``EnginePool``
spreads requests over the engines, so one engine is one server:

* Launch mode (``rollout.sglang.urls`` empty): the server is a ``sglang.launch_server`` process owned by a Ray actor
  with ``gpus_per_engine`` GPUs, on this engine's node (its URL is on ``cluster.host``, its checkpoints on local
  disk), listening on ``base_port + i``. It starts at the first weight update, from that checkpoint: a server
  needs a model to start with, and that one is exactly the trainer's policy. Its log goes to
  ``<workdir>/sglang_server.log``; a server that is not healthy within ``startup_timeout_s`` is an error naming
  the engine, its URL and the log's last lines. With ``cluster.placement=colocated`` the server shares the trainers'
  GPUs instead of holding its own in Ray's books (``sglang_server.server_gpus``), within its
  ``--mem-fraction-static``: unlike the local engine it keeps its memory while the trainers train. The server's
  process, its actor and their checks are ``sglang_server.LaunchedServer``'s.
* Attach mode: the server at ``urls[i]`` runs already, started by someone else; ``router_url``, if set, carries
  the generation requests (weights still go to every server, through its own engine).
* Weights go through the filesystem (``weight_sync=disk``): ``update_weights`` writes an HF checkpoint under
  ``weights_dir`` (which the server must see) and calls ``/update_weights_from_disk`` with the version. Or, for a
  server on this engine's node (``tensor``, slower than the disk wherever measured), as tensors in shared memory
  through ``/update_weights_from_tensor``: the server maps the pages and copies them into its parameters; a
  checkpoint is written only for a server to start (or restart) from, and the engine keeps the last weights for
  that. NCCL (``/init_weights_update_group`` + ``/update_weights_from_distributed``) is not implemented.
* Every answer carries the server's weight version; one from other weights than the last pushed is refused (the
  server is given the current checkpoint again and the batch re-sent), so stale samples never reach the trainer.
* Partial rollouts: the actor takes a weight push beside a generate call (``WeightHandoff``). The call polls its
  ``/generate`` (sent from a thread of its own); when a push is waiting it pauses the server with ``mode=abort``
  (SGLang aborts every request in flight, each answering with the tokens it sampled so far, and holds new ones),
  loads the checkpoint, continues the server, and sends every unfinished sample again as its prompt plus its tokens
  so far, for the tokens it has left, with its own seed. Each token records its version. Through a router a push
  waits for the call under way instead: pausing this engine's server would abort the requests other engines routed
  there, and this engine's requests may be running on other servers. So does every push with
  ``partial_rollouts=false``.
* A failed request (or one the server aborted without a push: someone else paused it) is sent again with
  exponential backoff, ``max_retries`` times, each sample from the tokens it got. When the server is dead (its
  process exited, or it fails its health check), or keeps failing, the engine stops it and leaves (its actor
  exits): the pool then re-sends the batch to the engines still serving and starts a new engine in this slot, which
  gets the current weights before it serves - in launch mode on a fresh server, in attach mode once the server at
  its URL is healthy again (``startup_timeout_s`` at most, then an error naming the URL).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import OmegaConf
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from rlfw.cluster.address import host_port, resolve
from rlfw.config.schema import SGLangConfig
from rlfw.model.hf_checkpoint import architecture, read_hf_config, save_hf_checkpoint
from rlfw.model.hf_convert import hf_config
from rlfw.model.shape import ModelShape
from rlfw.rollout.engines.base import Engine
from rlfw.rollout.engines.handoff import WeightHandoff
from rlfw.rollout.engines.sglang_client import (
    CONNECT_TIMEOUT_S,
    Output,
    RequestRejected,
    ServerError,
    SGLangClient,
    request_seeds,
)
from rlfw.rollout.engines.sglang_server import LaunchedServer, wait_healthy
from rlfw.rollout.types import Generation, PartialResponse, SamplingParams

GENERATE_POLL_S = 0.05  # how often a generate call looks for a weight push while its /generate runs


def save_server_checkpoint(
    directory: str | Path, hf_state: dict[str, torch.Tensor], shape: ModelShape, eos_token_id: int
) -> Path:
    """An HF checkpoint an SGLang server starts from (``--model-path``) or loads (``/update_weights_from_disk``).

    On top of ``save_hf_checkpoint``: SGLang picks the model class from ``architectures``, and stops at the config's
    ``eos_token_id`` whatever the request says, so both must be right.
    """
    path = save_hf_checkpoint(directory, hf_state, shape)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    config["eos_token_id"] = eos_token_id
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


class SGLangEngine(Engine):
    """Samples from one SGLang server holding the policy last pushed with ``update_weights``."""

    supports_partial_rollout = True

    def __init__(
        self,
        cfg: SGLangConfig,
        shape: ModelShape,
        eos_token_id: int,
        seed: int,
        index: int,
        host: str,
        workdir: str | Path,
        cpus_per_engine: float = 0.5,
        joined: bool = False,
        colocated: bool = False,
    ) -> None:
        if cfg.weight_sync not in ("disk", "tensor"):
            raise NotImplementedError(
                f"rollout.sglang.weight_sync={cfg.weight_sync!r}: disk and tensor are implemented; NCCL pushes "
                "(distributed) are not"
            )
        self.cfg = cfg
        self.shape = shape
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.index = index
        self.host = resolve(host, joined)  # the cluster.host rule, resolved on this engine's node
        self.workdir = Path(workdir).resolve()
        self.weights_dir = (Path(cfg.weights_dir) / f"engine_{index}" if cfg.weights_dir else self.workdir).resolve()
        self.launch = not cfg.urls
        self.tensor_sync = cfg.weight_sync == "tensor"
        if not self.launch and index >= len(cfg.urls):
            raise ValueError(f"SGLang engine {index} has no server: rollout.sglang.urls lists {len(cfg.urls)}")
        url = f"http://{host_port(self.host, cfg.base_port + index)}" if self.launch else cfg.urls[index]
        self.name = f"SGLang engine {index}"
        self.server = SGLangClient(url, cfg.request_timeout_s, cfg.control_timeout_s)
        self.router = (
            SGLangClient(cfg.router_url, cfg.request_timeout_s, cfg.control_timeout_s) if cfg.router_url else None
        )
        self.log_path = self.workdir / "sglang_server.log"
        self.weight_version: int | None = None
        self._checkpoint: Path | None = None
        self._state: dict[str, torch.Tensor] | None = None  # tensor pushes: the weights last pushed
        self._launched = (
            LaunchedServer(self.name, cfg, index, self.host, self.server, self.log_path, cpus_per_engine, colocated)
            if self.launch else None
        )
        self.server_pid: int | None = None  # launch mode: the last server process started
        self._paused = False  # the server was paused to take a push, and is to continue once loaded
        self._model_checked = self.launch  # attach mode: the server's model is checked before the first push
        # A push waits for the call under way to reach its next poll (at worst it is checking a failed server and
        # reloading it, or backing off), then for the pause and the load (at worst a restart).
        self._handoff = WeightHandoff(
            timeout_s=cfg.startup_timeout_s + 2 * cfg.weight_update_timeout_s + 4 * cfg.control_timeout_s
            + cfg.retry_backoff_s * 2**cfg.max_retries
        )

    @classmethod
    def init_kwargs(cls, cfg, shape: ModelShape, tokenizer, seed: int, index: int, workdir: Path) -> dict[str, Any]:
        sglang = cfg.rollout.sglang
        if OmegaConf.is_config(sglang):
            sglang = SGLangConfig(**OmegaConf.to_container(sglang, resolve=True))
        return {
            "cfg": sglang,
            "shape": shape,
            "eos_token_id": tokenizer.eos_token_id,
            "seed": seed,
            "index": index,
            "host": cfg.cluster.host,
            "joined": bool(cfg.cluster.address),
            "workdir": workdir,
            "cpus_per_engine": cfg.rollout.cpus_per_engine,
            "colocated": cfg.cluster.placement == "colocated",
        }

    def update_weights(self, hf_state: dict[str, torch.Tensor], version: int) -> None:
        """Make the server load ``hf_state`` as ``version``, as a checkpoint or as tensors (``weight_sync``): at once,
        or, during a generate call, when the call takes it (see ``generate``); returns once loaded."""
        if self.tensor_sync:
            state = SGLangClient.shared(hf_state)
            self._handoff.load(lambda: self._load(None, version, state), f"weights v{version}")
            return
        path = self._write_checkpoint(hf_state, version)

        def apply() -> None:
            previous = self._checkpoint
            self._load(path, version)
            self._remove_checkpoint(previous, path)

        self._handoff.load(apply, f"weights v{version}")

    def _write_checkpoint(self, hf_state: dict[str, torch.Tensor], version: int) -> Path:
        path = self.weights_dir / f"v{version}"
        partial = self.weights_dir / f"v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_server_checkpoint(partial, hf_state, self.shape, self.eos_token_id)
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # whole or not at all
        return path

    def _remove_checkpoint(self, previous: Path | None, current: Path) -> None:
        if previous is not None and previous != current and previous.parent == self.weights_dir:
            shutil.rmtree(previous, ignore_errors=True)

    def update_weights_from_dir(self, path: str, version: int) -> None:
        """Load the HF checkpoint directory ``path`` (as the server sees the filesystem) as ``version``."""
        self._handoff.load(lambda: self._load(Path(path).resolve(), version), f"weights v{version} from {path}")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One response per prompt from the server (or the router), with the log-probs ``sglang_client`` describes.

        ``params.seed`` gives every request its own ``sampling_seed`` (kept when a request is sent again), which
        SGLang honours when launched with ``--enable-deterministic-inference``. Weights pushed during the call are
        taken between two polls of its ``/generate``: the server is paused (its requests answer with the tokens so
        far), loads them and continues, and every unfinished sample goes on from its prompt and its tokens under
        them (a partial rollout; not through a router: see the module docstring).
        """
        self._require_weights()
        if not prompts:
            return []
        started = time.perf_counter()
        seeds = request_seeds(params.seed, len(prompts)) if params.seed is not None else [None] * len(prompts)
        samples = [_Sample(list(p), seed, params.max_new_tokens, self.eos_token_id) for p, seed in zip(prompts, seeds)]
        with self._handoff.generating():
            failure = self._generate(samples, params, started)
        if failure is not None:  # outside the call's span: weights pushed meanwhile are loaded before we leave
            raise self._leave(failure)
        return [sample.generation() for sample in samples]

    def _generate(self, samples: list["_Sample"], params: SamplingParams, started: float) -> str | None:
        """Send the unfinished samples until none is left; returns None, or why the engine must leave."""
        errors: list[str] = []
        while True:
            self._handoff.take()  # weights pushed while none of our requests was in flight load now
            running = [sample for sample in samples if sample.finish_reason is None]
            if not running:
                return None
            if errors:
                if len(errors) > self.cfg.max_retries:
                    return f"/generate failed {len(errors)} times: {' | '.join(errors)}"
                time.sleep(self.cfg.retry_backoff_s * 2 ** (len(errors) - 1))
            try:
                self._send(running, params, started)
            except ServerError as e:
                errors.append(str(e))
                broken = self._serving_error()
                if broken is not None:
                    return f"{broken} (during /generate: {e})"

    def _send(self, running: list["_Sample"], params: SamplingParams, started: float) -> None:
        """One ``/generate`` of the ``running`` samples, each its prompt and tokens so far for what it has left,
        interrupted by a weight push (see ``generate``); the samples take what it answers. ServerError when it
        fails, or when the server aborted requests that no push interrupted (they keep what they sampled)."""
        version = self.weight_version
        client = self.router or self.server
        seeds = None if running[0].seed is None else [sample.seed for sample in running]
        answer = _in_thread(client.generate, [s.prompt + s.tokens for s in running], params, [self.eos_token_id],
                            str(version), seeds, [s.budget - len(s.tokens) for s in running])
        # The HTTP call has its own timeouts; this deadline also covers a server that trickles bytes.
        deadline = time.monotonic() + CONNECT_TIMEOUT_S + self.cfg.request_timeout_s
        interrupted = False
        while not futures.wait([answer], timeout=GENERATE_POLL_S).done:
            if time.monotonic() > deadline:
                raise ServerError(client.url, f"/generate did not answer within {self.cfg.request_timeout_s}s")
            if self.router is None and self.cfg.partial_rollouts and self._handoff.take(before=self._pause):
                interrupted = True
                if self._paused:
                    self._paused = False
                    self.server.continue_generation()
        outputs = answer.result()
        seconds = time.perf_counter() - started
        for sample, output in zip(running, outputs):
            sample.extend(output, version, seconds)
        aborted = [output.message for output in outputs if output.finish == "abort"]
        if aborted and not interrupted:
            raise ServerError(client.url, f"the server aborted {len(aborted)} requests: {aborted[0]}")

    def _pause(self) -> None:
        """Abort our requests in flight (each answers with its tokens so far) and hold new ones until the load is
        done. A server that cannot be paused is left to the load, which restarts a dead one (and waits, on a server
        without the endpoint, for the requests to finish): SGLang loads only once no request is in flight, so the
        tokens in flight stay under the old weights either way."""
        self._paused = True  # continued after the load unless the server refused the pause outright: a pause that
        try:  # timed out on our side may still have paused it
            self.server.pause_generation()
        except (ServerError, RequestRejected) as e:
            self._paused = not isinstance(e, RequestRejected)
            print(f"{self.name}: /pause_generation failed, loading without it: {e}", file=sys.stderr, flush=True)

    def health(self) -> dict[str, Any]:
        """This engine's facts, at once. Not the server's ``/health_generate``: SGLang 0.5 answers it a second later
        at the earliest (it polls for its one-token generation once a second), the pool asks before every rollout,
        and with ``loop=async`` that second let the push land before the rollout's first request. A server that died
        fails the rollout's first request, which checks it (``_serving_error``)."""
        return {**super().health(), "url": self.server.url, "server_pid": self.server_pid}

    def shutdown(self) -> None:
        """Stop the launched server (its whole process group) and its actor."""
        if self._launched is not None:
            self._launched.stop()

    # --- the server ------------------------------------------------------------------------------------------

    def _load(self, path: Path | None, version: int, state: dict[str, torch.Tensor] | None = None) -> None:
        """Make the server hold the checkpoint ``path``, or the tensors ``state``, as ``version``. If that fails, the
        engine goes on naming the weights it held before: its tokens are labelled with ``weight_version``, which must
        never name weights the server lacks."""
        held = self._checkpoint, self._state, self.weight_version
        if state is None:
            self._checkpoint, self._state = path, None
        else:
            self._state = state
        self.weight_version = version
        try:
            if self._launched is not None and not self._launched.placed:
                self._start_server()
                return
            try:
                if not self._model_checked:
                    self._require_policy_architecture()
                self._push_weights()
            except ServerError as e:
                # Down: a launched server is replaced; an attached one must come back (its supervisor restarts it).
                if self.launch:
                    self._start_server()
                else:
                    wait_healthy(self.server, self.name, self.cfg, f"after a failed weight update ({e.reason})")
                    self._push_weights()
        except BaseException:
            self._checkpoint, self._state, self.weight_version = held
            raise

    def _push_weights(self) -> None:
        try:
            if self._state is not None:
                self.server.update_weights_from_tensor(list(self._state.items()), str(self.weight_version),
                                                       max(1, self.cfg.gpus_per_engine),
                                                       self.cfg.weight_update_timeout_s)
            else:
                self.server.update_weights_from_disk(
                    str(self._checkpoint), str(self.weight_version), self.cfg.weight_update_timeout_s
                )
        except RequestRejected as e:
            source = "tensors" if self._state is not None else self._checkpoint
            raise RuntimeError(f"{self.name} at {self.server.url} could not load weights v{self.weight_version} "
                               f"from {source}: {e}") from e

    def _require_policy_architecture(self) -> None:
        """An attached server must serve a model of the policy's architecture: SGLang 0.5.23 loads a checkpoint of
        another shape into its running model and dies of it, and one of other RoPE or norm settings would answer
        with other log-probs. Checked where the server's model directory is readable here (a hub name is not)."""
        model_path = str(self.server.model_info().get("model_path"))
        if not (Path(model_path) / "config.json").is_file():
            return
        ours = architecture(hf_config(self.shape))
        try:
            theirs = architecture(read_hf_config(model_path))
        except (ValueError, KeyError) as e:  # a model rlfw cannot train either
            differences = f"{type(e).__name__}: {e}"
        else:
            differences = ", ".join(f"{key} {theirs[key]} (policy: {ours[key]})" for key in ours
                                    if theirs[key] != ours[key])
        if differences:
            raise RuntimeError(
                f"{self.name}: the server at {self.server.url} serves {model_path}, which is not of the policy's "
                f"architecture ({differences}): SGLang could not load the policy's weights into it. Start it from "
                "the policy's checkpoint (model.hf_path), or set the model.* keys to its architecture"
            )
        self._model_checked = True

    def _serving_error(self) -> str | None:
        """None when the server can take the batch again (given the current weights if it lost them); else why
        not."""
        if self._launched is not None and self._launched.placed:
            ended = self._launched.exit_error()
            if ended is not None:
                return ended
        for client in [self.server] + ([self.router] if self.router else []):
            error = client.health_error()
            if error is not None:
                return f"{client.url} failed its health check: {error}"
        try:
            if str(self.server.model_info().get("weight_version")) != str(self.weight_version):
                self._push_weights()
        except (ServerError, RuntimeError) as e:
            return f"{self.name} could not be given weights v{self.weight_version}: {e}"
        return None

    def _leave(self, reason: str) -> RuntimeError:
        """Stop the server and end this engine's actor: the pool re-sends the batch elsewhere and replaces us.

        Outside an actor (no pool to re-send) it returns the error for the caller to raise.
        """
        print(f"{self.name} leaves: {reason}", file=sys.stderr, flush=True)
        self.shutdown()
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            ray.actor.exit_actor()
        return RuntimeError(f"{self.name} at {self.server.url} gave up: {reason}")

    def _start_server(self) -> None:
        """(Re)start the launched server from the current checkpoint and wait until it is healthy."""
        if self._state is not None:  # tensor pushes: a checkpoint of the weights last pushed, to start from
            previous, self._checkpoint = self._checkpoint, self._write_checkpoint(self._state, self.weight_version)
            self._remove_checkpoint(previous, self._checkpoint)
        self.server_pid = self._launched.start(str(self._checkpoint), str(self.weight_version), self.seed)


class _Sample(PartialResponse):
    """One response across the ``/generate`` requests it took: a continuation follows every interruption."""

    def __init__(self, prompt: list[int], seed: int | None, budget: int, eos_token_id: int) -> None:
        super().__init__()
        self.prompt, self.seed, self.budget, self.eos_token_id = prompt, seed, budget, eos_token_id

    def extend(self, output: Output, version: int, seconds: float) -> None:
        """Append what one request sampled under ``version``; an aborted one ends the sample only when it reached
        the stop token (SGLang keeps the token of the step that took the abort) or the budget."""
        self.add(output.tokens, output.logprobs, version)
        if output.tokens:
            self.seconds = seconds
        if output.finish != "abort":
            self.finish_reason = output.finish
        elif output.tokens and output.tokens[-1] == self.eos_token_id:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.budget:
            self.finish_reason = "length"


def _in_thread(call: Callable[..., Any], *args: Any) -> futures.Future:
    """Run ``call(*args)`` in a daemon thread of its own: a poll can give up on it (a deadline) and move on."""
    future: futures.Future = futures.Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as e:  # noqa: BLE001  (handed to the caller, who raises it)
            future.set_exception(e)

    threading.Thread(target=run, name="sglang-generate", daemon=True).start()
    return future

