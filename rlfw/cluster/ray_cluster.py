"""Start (or join) Ray with every listener on the configured interface, loopback by default."""

from __future__ import annotations

import os
import socket
from typing import Dict

import ray


def worker_env(host: str, torch_threads: int) -> Dict[str, str]:
    """Environment of every rlfw worker process."""
    env = {
        "OMP_NUM_THREADS": str(torch_threads),
        "MKL_NUM_THREADS": str(torch_threads),
        "TOKENIZERS_PARALLELISM": "false",
        "RLFW_TORCH_THREADS": str(torch_threads),
        "RLFW_HOST": host,
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),  # torchft's Rust side logs every quorum at INFO
    }
    if host == "127.0.0.1":
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo picks the interface of the hostname otherwise
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


def start_ray(cluster) -> None:
    """``ray.init`` on ``cluster.host`` (or join ``cluster.address``), with rlfw's worker environment.

    Inside a Ray worker (a job of ``hydra/launcher=ray``) the process is already on the cluster that rlfw's sweep
    callback started, with that environment: it stays attached.
    """
    if in_ray_worker():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RUST_LOG", "warn")  # the driver's torchft Lighthouse logs every quorum at INFO
    kwargs = dict(
        runtime_env={"env_vars": worker_env(cluster.host, cluster.torch_threads)},
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    if cluster.address:
        if cluster.address != "auto":
            check_reachable(cluster.address)
        ray.init(address=cluster.address, **kwargs)
    else:
        ray.init(num_cpus=cluster.num_cpus, _node_ip_address=cluster.host, **kwargs)


def stop_ray() -> None:
    """Shut down the Ray this process started or joined; a Ray worker leaves its cluster to the launcher."""
    if ray.is_initialized() and not in_ray_worker():
        ray.shutdown()
