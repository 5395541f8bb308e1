"""Start (or join) Ray: a local instance on loopback (or the address ``cluster.host`` names), or a cluster."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Dict, Optional

import ray

from rlfw.cluster.address import resolve
from rlfw.cluster.worker_setup import KNOWN_WARNINGS_ENV


def worker_env(torch_threads: int, known_warnings_log: Optional[str] = None) -> Dict[str, str]:
    """Environment of every rlfw worker process. (Addresses are not in it: each process resolves ``cluster.host``
    on its own node, ``rlfw.cluster.address``.)"""
    env = {
        "OMP_NUM_THREADS": str(torch_threads),
        "MKL_NUM_THREADS": str(torch_threads),
        "TOKENIZERS_PARALLELISM": "false",
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),  # torchft's Rust side logs every quorum at INFO
    }
    if known_warnings_log:
        env[KNOWN_WARNINGS_ENV] = known_warnings_log
    return env


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once, naming the address, instead of letting Ray retry an unreachable GCS for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"cluster.address={address!r} is not host:port (or 'auto')")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"cluster.address={address} is unreachable: {e}") from None


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker, e.g. a sweep job that Hydra's Ray launcher runs as a task."""
    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


_kept_running = False  # set by keep_ray_running: train() calls attach to this process' Ray and leave it up


def start_ray(cluster, known_warnings_log: Optional[str] = None) -> None:
    """``ray.init`` of a local instance on ``cluster.host``'s address (or join ``cluster.address``), with rlfw's
    worker environment.

    Without ``cluster.address`` this is always a fresh local instance (``address="local"``): Ray's own address
    discovery would otherwise join whatever cluster a ``ray start`` left on this machine. Inside a Ray worker (a job
    of ``hydra/launcher=ray``) the process is already on the cluster that rlfw's sweep callback started, with that
    environment, and under ``keep_ray_running`` on the instance that started: both stay attached.
    ``known_warnings_log``: where every worker writes the known harmless start-up warnings (``worker_setup``).
    """
    if in_ray_worker() or (_kept_running and ray.is_initialized()):
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray starts one idle worker per CPU for the first driver, without the job's runtime environment (rlfw's worker
    # environment and set-up hook), so no actor or task of the run can use them: they only take CPU at start-up.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    os.environ.setdefault("RUST_LOG", "warn")  # the driver's torchft Lighthouse logs every quorum at INFO
    kwargs = dict(
        runtime_env={"env_vars": worker_env(cluster.torch_threads, known_warnings_log),
                     "worker_process_setup_hook": "rlfw.cluster.worker_setup.setup_process"},
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    if cluster.address:
        if cluster.address != "auto":
            check_reachable(cluster.address)
        ray.init(address=cluster.address, **kwargs)
    else:
        host = resolve(cluster.host, joined=False)
        ray.init(address="local", num_cpus=cluster.num_cpus, _node_ip_address=host, **kwargs)


def stop_ray() -> None:
    """Shut down the Ray this process started or joined; a Ray worker leaves its cluster to the launcher, and
    ``keep_ray_running`` leaves its instance to the end of the block."""
    if ray.is_initialized() and not in_ray_worker() and not _kept_running:
        ray.shutdown()


@contextlib.contextmanager
def keep_ray_running(cluster):
    """Several ``train()`` calls in one process share one Ray instance, started here on ``cluster`` and shut down
    when the block ends (the test suite uses it: Ray's start-up is paid once, not once per run). Every run's actors
    and placement groups are still released when that run ends."""
    global _kept_running
    start_ray(cluster)
    _kept_running = True
    try:
        yield
    finally:
        _kept_running = False
        stop_ray()
