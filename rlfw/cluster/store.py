"""TCPStores bound to one interface.

``torch.distributed.TCPStore`` listens on all interfaces whatever ``host_name`` says. Handing it a socket we bound
ourselves (``master_listen_fd``) keeps it on ``host``; port 0 lets the OS choose, so concurrent cells and runs
never collide and no port is reserved-then-released (a race).
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import TCPStore


def serve_store(host: str, timeout_s: float = 60.0) -> TCPStore:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return TCPStore(
        host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),  # the store owns the descriptor from here on
    )


def connect_store(host: str, port: int, timeout_s: float = 60.0) -> TCPStore:
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
