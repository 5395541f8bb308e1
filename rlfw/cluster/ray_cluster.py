"""Start (or join) Ray with every listener on the configured interface, loopback by default."""

from __future__ import annotations

import os
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


def start_ray(cluster) -> None:
    """``ray.init`` on ``cluster.host`` (or join ``cluster.address``), with rlfw's worker environment."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RUST_LOG", "warn")  # the driver's torchft Lighthouse logs every quorum at INFO
    kwargs = dict(
        runtime_env={"env_vars": worker_env(cluster.host, cluster.torch_threads)},
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    if cluster.address:
        ray.init(address=cluster.address, **kwargs)
    else:
        ray.init(num_cpus=cluster.num_cpus, _node_ip_address=cluster.host, **kwargs)
