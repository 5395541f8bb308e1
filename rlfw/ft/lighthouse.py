"""The torchft Lighthouse: decides each step's quorum (which cells participate) and its membership epoch."""

from __future__ import annotations

from torchft.coordination import LighthouseServer


class Lighthouse:
    """Runs in the driver process, bound to ``host`` (loopback by default)."""

    def __init__(self, host: str, port: int, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float):
        self._server = LighthouseServer(
            bind=f"{host}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=int(join_timeout_s * 1000),
            quorum_tick_ms=20,
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )
        # address() advertises the machine's hostname; clients must use the interface we bound.
        self.address = f"http://{host}:{self._server.address().rsplit(':', 1)[1]}"

    def shutdown(self) -> None:
        self._server.shutdown()
