"""The torchft Lighthouse: decides each step's quorum (which cells participate) and its membership epoch, and
hears every cell's heartbeat."""

from __future__ import annotations

import urllib.request
from typing import Dict

from rlfw.cluster.address import host_port, node_address
from rlfw.ft.torchft_api import LighthouseServer, parse_heartbeats


class Lighthouse:
    """Runs in the driver process, bound to ``host`` (loopback by default)."""

    def __init__(self, host: str, port: int, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float):
        self._server = LighthouseServer(
            bind=host_port(host, port),
            min_replicas=min_replicas,
            join_timeout_ms=int(join_timeout_s * 1000),
            quorum_tick_ms=20,
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )
        # address() advertises the machine's hostname; clients must use the interface we bound.
        self.address = f"http://{host_port(host, int(self._server.address().rsplit(':', 1)[1]))}"

    def shutdown(self) -> None:
        self._server.shutdown()


def heartbeat_ages(address: str, timeout_s: float = 2.0) -> Dict[str, float]:
    """Seconds since the Lighthouse at ``address`` last heard each replica id (every replica it ever heard: a dead
    incarnation stays listed, ageing). A torchft Manager heartbeats from native threads, so a cell busy in Python
    compute still beats; a stopped, partitioned or vanished one does not. Raises OSError if it cannot be read."""
    with urllib.request.urlopen(f"{address}/status", timeout=timeout_s) as response:
        page = response.read().decode()
    return parse_heartbeats(page)


def start_lighthouse(cfg, role: str):
    """(the Lighthouse this group started or None, the address its cells join). The policy's is the external
    ``ft.lighthouse_address`` or one on ``ft.lighthouse_port``; the critic's quorums are its own, so it always gets
    a Lighthouse of its own, on a free port (never the policy's port, which is taken)."""
    ft = cfg.ft
    if role == "actor" and ft.lighthouse_address:
        return None, ft.lighthouse_address
    port = ft.lighthouse_port if role == "actor" else 0
    lighthouse = Lighthouse(node_address(cfg.cluster), port, ft.min_cells, ft.join_timeout_s, ft.heartbeat_timeout_s)
    return lighthouse, lighthouse.address
