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
from pathlib import Path

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
