"""Launch mode: one ``sglang.launch_server`` process per engine, owned by a Ray actor that holds its GPUs.

The actor is scheduled with ``num_gpus``, so Ray sets ``CUDA_VISIBLE_DEVICES`` to its GPUs and the server process
inherits it: SGLang sees exactly the devices Ray gave this engine. With ``cluster.placement=colocated`` the server
shares the trainers' GPUs, which Ray has already given to them: its actor asks for none (Ray then leaves every GPU
of the node visible), ``--base-gpu-id`` spreads the engines over them, and ``--mem-fraction-static`` bounds what the
server takes (``server_gpus``; ``rlfw.config.devices`` checks that flag and what it leaves the trainers). The
process runs in a session (and process group) of its own because SGLang forks a scheduler and a detokenizer per
server; stopping the group stops them all, and nothing is left holding GPU memory or the port. Should the actor die
instead, Ray ends its child, the server, and SGLang's processes end themselves when their parent dies
(``PR_SET_PDEATHSIG``).

``LaunchedServer`` is the engine's side of it: where the actor goes, (re)starting the server from a checkpoint, the
checks that fail at once rather than at the startup deadline (GPUs the node lacks, a port another process holds),
the wait until it is healthy, and its exit code and log when it dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlfw.cluster.address import host_port
from rlfw.config.schema import SGLangConfig
from rlfw.rollout.engines.sglang_client import SGLangClient

HEALTH_POLL_S = 1.0

# `{python}` is the interpreter of the actor that starts the server (the environment rlfw runs in).
DEFAULT_LAUNCH_COMMAND = ["{python}", "-m", "sglang.launch_server"]


def launch_argv(
    command: list[str],
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    weight_version: str,
    seed: int,
    extra_args: list[str],
) -> list[str]:
    """The server's command line: ``command`` plus the SGLang 0.5.23 flags rlfw relies on, then ``extra_args``.

    ``--skip-tokenizer-init``: rlfw sends and reads token ids only, and the checkpoints it writes carry no tokenizer.
    """
    program = [part.replace("{python}", sys.executable) for part in command]
    return program + [
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--weight-version", weight_version,
        "--random-seed", str(seed),
        "--skip-tokenizer-init",
        *extra_args,
    ]  # fmt: skip


def port_taken(host: str, port: int) -> str | None:
    """Why a server cannot listen on ``host:port`` (another process listens there), or None. Binds as the server
    does (``SO_REUSEADDR``: connections of an ended server waiting out TIME_WAIT do not count)."""
    family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            return e.strerror or str(e)
    return None


def server_gpus(gpus_per_engine: int, colocated: bool, index: int, node_gpus: int) -> tuple[int, list[str]]:
    """Ray GPUs of engine ``index``'s server actor, and the flags placing the server on the node's ``node_gpus``."""
    if not colocated or gpus_per_engine == 0:
        return gpus_per_engine, []
    return 0, ["--base-gpu-id", str(index * gpus_per_engine % node_gpus)]


# rlfw stops and restarts its servers itself (SIGTERM to the process group). SGLang takes the SIGTERM of its scheduler
# for a crash and sleeps 5 s before its crash diagnostics (py-spy dumps, CUDA core dumps; 60 s more for the latter):
# off for servers rlfw launches, unless the environment rlfw runs in sets them.
CRASH_DIAGNOSTICS_OFF = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class ServerProcess:
    """One server process and its log file; run it as a Ray actor (see ``SGLangEngine``)."""

    def __init__(self, name: str, log_path: str) -> None:
        self.name = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._process: subprocess.Popen | None = None
        self._tmp: str | None = None

    def start(self, argv: list[str]) -> int:
        """Start the server (stopping a previous one first); returns its pid. Its temporary files (SGLang names its
        IPC sockets with ones it never removes, and locks a weights path it looks up) go to a folder of its own
        (``TMPDIR``), removed when it stops."""
        self.stop()
        self._tmp = tempfile.mkdtemp(prefix="rlfw-sglang-")
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name}: {' '.join(argv)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**CRASH_DIAGNOSTICS_OFF, **os.environ, "TMPDIR": self._tmp},
            )
        return self._process.pid

    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def returncode(self) -> int | None:
        """None while the server process runs (or was never started); its exit code once it ended."""
        return self._process.poll() if self._process is not None else None

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log yet)"
        with open(self.log_path, errors="replace") as log:
            return "".join(deque(log, maxlen=lines))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL whatever is left after ``grace_s``."""
        if self._process is None:
            return
        group = self._process.pid  # the leader of its own session: its pid is the group id
        signal_group(group, signal.SIGTERM)
        signal_group(group, signal.SIGCONT)  # a stopped server (SIGSTOP) takes its SIGTERM only once it runs
        try:
            self._process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Children can outlive the leader (or ignore SIGTERM): the group goes in any case.
        signal_group(group, signal.SIGKILL)
        try:
            self._process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:  # stuck in the kernel (uninterruptible I/O, a wedged driver)
            raise RuntimeError(f"{self.name}: server process {group} did not end {grace_s:g} s after SIGKILL") from None
        self._process = None
        shutil.rmtree(self._tmp, ignore_errors=True)


def signal_group(group: int, sig: signal.Signals) -> None:
    """Signal a server's process group (its pid), if any of it is left."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass  # the whole group already exited


def wait_healthy(client: SGLangClient, name: str, cfg: SGLangConfig, why: str,
                 exited: Callable[[], str | None] = lambda: None, log_tail: Callable[[], str] | None = None) -> None:
    """Poll ``client``'s health until it answers, at most ``cfg.startup_timeout_s``; ``exited`` says why the server
    can no longer become healthy (its process ended), or None."""
    deadline = time.monotonic() + cfg.startup_timeout_s
    error = "not checked yet"
    while time.monotonic() < deadline:
        ended = exited()
        if ended is not None:
            raise RuntimeError(f"{name} at {client.url} {ended} while waiting {why}: see its log; its command line "
                               "(the log's first line) is rollout.sglang.launch_command with rlfw's flags and "
                               f"rollout.sglang.extra_args; {log_tail() if log_tail else ''}")
        error = client.health_error(timeout_s=max(0.1, min(cfg.control_timeout_s, deadline - time.monotonic())))
        if error is None:
            return
        time.sleep(max(0.0, min(HEALTH_POLL_S, deadline - time.monotonic())))
    tail = f"; {log_tail()}" if log_tail else ""
    raise RuntimeError(
        f"{name} at {client.url} did not become healthy within rollout.sglang.startup_timeout_s="
        f"{cfg.startup_timeout_s}s while waiting {why} (last check: {error}){tail}"
    )


class LaunchedServer:
    """The server of engine ``index`` in launch mode, as its engine sees it: a ``ServerProcess`` actor on the
    engine's node (its GPUs in Ray's books, or none when colocated) and the server it runs."""

    def __init__(self, name: str, cfg: SGLangConfig, index: int, host: str, client: SGLangClient, log_path: Path,
                 cpus: float, colocated: bool) -> None:
        self.name, self.cfg, self.index, self.host, self.client = name, cfg, index, host, client
        self.log_path, self.cpus, self.colocated = log_path, cpus, colocated
        self.port = cfg.base_port + index
        self._actor: Any = None  # the ServerProcess actor, once placed
        self._gpu_args: list[str] = []

    @property
    def placed(self) -> bool:
        return self._actor is not None

    def start(self, checkpoint: str, weight_version: str, seed: int) -> int:
        """(Re)start the server from ``checkpoint`` and wait until it is healthy; returns its pid. On failure
        nothing half-started stays behind."""
        if self._actor is None:
            node = ray.get_runtime_context().get_node_id()
            gpus, self._gpu_args = server_gpus(self.cfg.gpus_per_engine, self.colocated, self.index,
                                               self._node_gpus(node))
            self._actor = (
                ray.remote(ServerProcess)
                .options(num_cpus=self.cpus, num_gpus=gpus,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(self.name, str(self.log_path))
            )
        else:  # the previous server goes first: it holds the port
            ray.get(self._actor.stop.remote(), timeout=self.cfg.control_timeout_s + 30)
        self._require_free_port()
        argv = launch_argv(list(self.cfg.launch_command), checkpoint, self.host, self.port,
                           max(1, self.cfg.gpus_per_engine), weight_version, seed,
                           self._gpu_args + list(self.cfg.extra_args))
        placing_s = self.cfg.startup_timeout_s + 60  # its actor waits for this node to have the GPUs it asks for
        try:
            pid = ray.get(self._actor.start.remote(argv), timeout=placing_s)
        except GetTimeoutError:
            self.stop()  # the pending actor goes too: the next start places one afresh
            raise RuntimeError(f"{self.name}: the actor of its server process (num_gpus="
                               f"{0 if self.colocated else self.cfg.gpus_per_engine} on this node) did not start "
                               f"within {placing_s:g} s: are the node's GPUs taken?") from None
        try:
            wait_healthy(self.client, self.name, self.cfg, "to start", self._exit_code, self.log_tail)
        except Exception:
            self.stop()
            raise
        return pid

    def exit_error(self) -> str | None:
        """Why the server cannot serve (its process ended, or its actor does not answer), or None."""
        try:
            ended = self._exit_code()
        except GetTimeoutError:
            return f"{self.name}'s server-process actor did not answer within {self.cfg.control_timeout_s:g} s"
        return None if ended is None else f"{self.name} at {self.client.url} {ended}; {self.log_tail()}"

    def log_tail(self) -> str:
        try:
            tail = ray.get(self._actor.log_tail.remote(), timeout=self.cfg.control_timeout_s)
        except (GetTimeoutError, RayActorError) as e:
            return f"its log {self.log_path} could not be read ({type(e).__name__})"
        return f"last lines of {self.log_path}:\n{tail}"

    def stop(self) -> None:
        """Stop the server (its whole process group) and its actor."""
        if self._actor is None:
            return
        try:
            ray.get(self._actor.stop.remote(), timeout=self.cfg.control_timeout_s + 30)
        except RayActorError:
            pass  # the actor died, and Ray ended its server with it
        except Exception as e:  # noqa: BLE001  (never placed, hung, or its server would not die: the kill ends it)
            print(f"{self.name}: stopping its server failed ({type(e).__name__}: {e}); killing its actor",
                  file=sys.stderr, flush=True)
        finally:
            ray.kill(self._actor)
            self._actor = None

    def _exit_code(self) -> str | None:
        code = ray.get(self._actor.returncode.remote(), timeout=self.cfg.control_timeout_s)
        return None if code is None else f"exited with code {code}"

    def _require_free_port(self) -> None:
        """Fails at once where another process listens on this server's port: SGLang would find out only once it
        loaded the model, and meanwhile the engine would take whatever answers there (another run's server) for its
        own, and push its weights to it. A server of ours that is ending may hold the port a moment longer."""
        deadline = time.monotonic() + self.cfg.control_timeout_s
        while (taken := port_taken(self.host, self.port)) is not None and time.monotonic() < deadline:
            time.sleep(HEALTH_POLL_S)
        if taken is not None:
            self.stop()
            raise RuntimeError(
                f"{self.name} cannot start its server on {host_port(self.host, self.port)}: the port is in use "
                f"({taken}), by another server or program; rollout.sglang.base_port={self.cfg.base_port} gives "
                "engine i the port base_port + i: set it to the first of rollout.num_engines free ports"
            )

    def _node_gpus(self, node: str) -> int:
        """This node's GPUs in Ray; fails at once, naming the key, where the server's actor could never be placed
        (Ray would wait for GPUs this node does not have)."""
        wanted = self.cfg.gpus_per_engine
        has = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
        if wanted > has:
            raise RuntimeError(
                f"{self.name}: rollout.sglang.gpus_per_engine={wanted} but this node has {has:g} GPUs in Ray; on CPU "
                "set rollout.sglang.gpus_per_engine=0 with a CPU build of SGLang (`make run ARGS=\"rollout=sglang\"` "
                "sets one up), or run on a node with GPUs"
            )
        return int(has)
