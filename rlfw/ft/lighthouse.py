"""The torchft Lighthouse: decides each step's quorum (which cells participate) and its membership epoch, and
hears every cell's heartbeat."""

from __future__ import annotations

import re
import urllib.request
from typing import Dict

from torchft.coordination import LighthouseServer

from rlfw.cluster.address import host_port

# One line per replica on the Lighthouse's /status page (torchft 0.2.0's templates/status.html), e.g.
# ``cell_1:4f0c...: seen 0.0123s ago``. torchft has no other way to read the heartbeats; tests/ft pins the format.
_HEARTBEAT = re.compile(r"^\s*(\S+): seen ([0-9.eE+-]+)s ago\s*$", re.MULTILINE)


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
    return {replica: float(age) for replica, age in _HEARTBEAT.findall(page)}
