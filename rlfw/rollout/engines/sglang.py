"""The SGLang engine: engine ``i`` of the run drives SGLang server ``i``, launched here or attached by URL.

It implements ``rlfw.rollout.engines.base.Engine`` over SGLang's HTTP API (``sglang_client``); the ``EnginePool``
spreads requests over the engines, so one engine is one server:

* Launch mode (``rollout.sglang.urls`` empty): the server is a ``sglang.launch_server`` process owned by a Ray actor
  with ``gpus_per_engine`` GPUs, on this engine's node (its URL is on ``cluster.host``, its checkpoints on local
  disk), listening on ``base_port + i``. It starts at the first weight update, from that checkpoint: a server
  needs a model to start with, and that one is exactly the trainer's policy. Its log goes to
  ``<workdir>/sglang_server.log``; a server that is not healthy within ``startup_timeout_s`` is an error naming
  the engine, its URL and the log's last lines.
* Attach mode: the server at ``urls[i]`` runs already, started by someone else; ``router_url``, if set, carries
  the generation requests (weights still go to every server, through its own engine).
* Weights go through the filesystem: ``update_weights`` writes an HF checkpoint under ``weights_dir`` (which the
  server must see) and calls ``/update_weights_from_disk`` with the version. Pushing tensors without the disk
  (``/update_weights_from_tensor`` from a same-node trainer, or ``/init_weights_update_group`` +
  ``/update_weights_from_distributed`` over NCCL) is not implemented: both need the trainer's weights on GPUs.
* Every answer carries the server's weight version; one from other weights than the last pushed is refused (the
  server is given the current checkpoint again and the batch re-sent), so stale samples never reach the trainer.
* A failed request is retried with exponential backoff, ``max_retries`` times. When the server is dead (its process
  exited, or it fails its health check), or keeps failing, the engine stops it and leaves (its actor exits): the
  pool then re-sends the batch to the engines still serving and starts a new engine in this slot, which gets the
  current weights before it serves - in launch mode on a fresh server, in attach mode once the server at its URL
  is healthy again (``startup_timeout_s`` at most, then an error naming the URL).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import OmegaConf
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from rlfw.cluster.address import resolve
from rlfw.config.schema import SGLangConfig
from rlfw.megatron.hf_checkpoint import save_hf_checkpoint
from rlfw.megatron.model import ModelShape
from rlfw.rollout.engines.base import Engine
from rlfw.rollout.engines.sglang_client import RequestRejected, ServerError, SGLangClient, request_seeds
from rlfw.rollout.engines.sglang_server import ServerProcess, launch_argv
from rlfw.rollout.types import Generation, SamplingParams

HEALTH_POLL_S = 1.0


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
    ) -> None:
        if cfg.weight_sync != "disk":
            raise NotImplementedError(
                f"rollout.sglang.weight_sync={cfg.weight_sync!r}: only 'disk' (/update_weights_from_disk) is "
                "implemented; tensor and NCCL pushes need the trainer's weights on the servers' GPUs"
            )
        self.cfg = cfg
        self.shape = shape
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.index = index
        self.host = resolve(host, joined)  # the cluster.host rule, resolved on this engine's node
        self.workdir = Path(workdir).resolve()
        self.weights_dir = (Path(cfg.weights_dir) / f"engine_{index}" if cfg.weights_dir else self.workdir).resolve()
        self.cpus_per_engine = cpus_per_engine
        self.launch = not cfg.urls
        if not self.launch and index >= len(cfg.urls):
            raise ValueError(f"SGLang engine {index} has no server: rollout.sglang.urls lists {len(cfg.urls)}")
        url = f"http://{host}:{cfg.base_port + index}" if self.launch else cfg.urls[index]
        self.name = f"SGLang engine {index}"
        self.server = SGLangClient(url, cfg.request_timeout_s, cfg.control_timeout_s)
        self.router = (
            SGLangClient(cfg.router_url, cfg.request_timeout_s, cfg.control_timeout_s) if cfg.router_url else None
        )
        self.log_path = self.workdir / "sglang_server.log"
        self.weight_version: int | None = None
        self._checkpoint: Path | None = None
        self._process: Any = None  # launch mode: the ServerProcess actor, once started
        self.server_pid: int | None = None  # launch mode: the last server process started

    @classmethod
    def init_kwargs(cls, cfg, shape: ModelShape, tokenizer, seed: int, workdir: Path) -> dict[str, Any]:
        sglang = cfg.rollout.sglang
        if OmegaConf.is_config(sglang):
            sglang = SGLangConfig(**OmegaConf.to_container(sglang, resolve=True))
        return {
            "cfg": sglang,
            "shape": shape,
            "eos_token_id": tokenizer.eos_token_id,
            "seed": seed,
            "index": _engine_index(workdir),
            "host": cfg.cluster.host,
            "joined": bool(cfg.cluster.address),
            "workdir": workdir,
            "cpus_per_engine": cfg.rollout.cpus_per_engine,
        }

    def update_weights(self, hf_state: dict[str, torch.Tensor], version: int) -> None:
        """Write ``hf_state`` as this version's checkpoint and make the server load it."""
        path = self.weights_dir / f"v{version}"
        partial = self.weights_dir / f"v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_server_checkpoint(partial, hf_state, self.shape, self.eos_token_id)
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)  # whole or not at all
        previous = self._checkpoint
        self._load(path, version)
        if previous is not None and previous != path and previous.parent == self.weights_dir:
            shutil.rmtree(previous, ignore_errors=True)

    def update_weights_from_dir(self, path: str, version: int) -> None:
        """Load the HF checkpoint directory ``path`` (as the server sees the filesystem) as ``version``."""
        self._load(Path(path).resolve(), version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One response per prompt from the server (or the router), with the log-probs ``sglang_client`` describes.

        ``params.seed`` gives every request its own ``sampling_seed`` (kept when a batch is re-sent), which SGLang
        honours when launched with ``--enable-deterministic-inference``.
        """
        self._require_weights()
        if not prompts:
            return []
        started = time.perf_counter()
        seeds = request_seeds(params.seed, len(prompts)) if params.seed is not None else None
        client = self.router or self.server
        errors = []
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                time.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
            try:
                generations = client.generate(
                    prompts, params, [self.eos_token_id], str(self.weight_version), seeds
                )
            except ServerError as e:
                errors.append(str(e))
                broken = self._serving_error()
                if broken is not None:
                    raise self._leave(f"{broken} (during /generate: {e})") from e
                continue
            seconds = time.perf_counter() - started  # until the whole batch answered
            return [dataclasses.replace(g, seconds=seconds) for g in generations]
        raise self._leave(f"/generate failed {len(errors)} times: {' | '.join(errors)}")

    def health(self) -> dict[str, Any]:
        return {**super().health(), "url": self.server.url, "server_pid": self.server_pid,
                "server_error": self.server.health_error()}

    def shutdown(self) -> None:
        """Stop the launched server (its whole process group) and its actor."""
        if self._process is not None:
            try:
                ray.get(self._process.stop.remote())
            except RayActorError:
                pass  # the actor died, and Ray ended its server with it
            ray.kill(self._process)
            self._process = None

    # --- the server ------------------------------------------------------------------------------------------

    def _load(self, path: Path, version: int) -> None:
        self._checkpoint, self.weight_version = path, version
        if self.launch and self._process is None:
            self._start_server()
            return
        try:
            self._push_weights()
        except ServerError as e:
            # Down: a launched server is replaced; an attached one must come back (its supervisor restarts it).
            if self.launch:
                self._start_server()
            else:
                self._wait_healthy(f"after a failed weight update ({e.reason})")
                self._push_weights()

    def _push_weights(self) -> None:
        try:
            self.server.update_weights_from_disk(
                str(self._checkpoint), str(self.weight_version), self.cfg.weight_update_timeout_s
            )
        except RequestRejected as e:
            raise RuntimeError(f"{self.name} at {self.server.url} could not load {self._checkpoint}: {e}") from e

    def _serving_error(self) -> str | None:
        """None when the server can take the batch again (given the current weights if it lost them); else why
        not."""
        if self._process is not None:
            exit_code = ray.get(self._process.returncode.remote())
            if exit_code is not None:
                return f"{self.name} at {self.server.url} exited with code {exit_code}; {self._log_tail()}"
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
        if self._process is None:
            node = ray.get_runtime_context().get_node_id()
            self._process = (
                ray.remote(ServerProcess)
                .options(
                    num_cpus=self.cpus_per_engine,
                    num_gpus=self.cfg.gpus_per_engine,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                )
                .remote(self.name, str(self.log_path))
            )
        argv = launch_argv(
            list(self.cfg.launch_command),
            str(self._checkpoint),
            self.host,
            self.cfg.base_port + self.index,
            max(1, self.cfg.gpus_per_engine),
            str(self.weight_version),
            self.seed,
            list(self.cfg.extra_args),
        )
        self.server_pid = ray.get(self._process.start.remote(argv))
        try:
            self._wait_healthy("to start")
        except RuntimeError:
            self.shutdown()  # nothing half-started stays behind
            raise

    def _wait_healthy(self, why: str) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        error = "not checked yet"
        while time.monotonic() < deadline:
            if self._process is not None:
                exit_code = ray.get(self._process.returncode.remote())
                if exit_code is not None:
                    raise RuntimeError(
                        f"{self.name} at {self.server.url} exited with code {exit_code} while waiting {why}; "
                        f"{self._log_tail()}"
                    )
            error = self.server.health_error(timeout_s=max(0.1, min(self.cfg.control_timeout_s,
                                                                     deadline - time.monotonic())))
            if error is None:
                return
            time.sleep(max(0.0, min(HEALTH_POLL_S, deadline - time.monotonic())))
        tail = f"; {self._log_tail()}" if self._process is not None else ""
        raise RuntimeError(
            f"{self.name} at {self.server.url} did not become healthy within rollout.sglang.startup_timeout_s="
            f"{self.cfg.startup_timeout_s}s while waiting {why} (last check: {error}){tail}"
        )

    def _log_tail(self) -> str:
        return f"last lines of {self.log_path}:\n{ray.get(self._process.log_tail.remote())}"


def _engine_index(workdir: Path) -> int:
    """The engine's slot, from the ``<run_dir>/rollout/engine_<i>`` directory the factory gives it."""
    name = Path(workdir).name
    if not name.startswith("engine_") or not name.removeprefix("engine_").isdigit():
        raise ValueError(f"cannot tell the engine index from its workdir {workdir} (expected .../engine_<i>)")
    return int(name.removeprefix("engine_"))
