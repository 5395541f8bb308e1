"""Every name rlfw takes from torchft, and every way it reaches inside: moving to another torchft is this file.

Public API: ``Manager``, the process groups (Gloo, NCCL), the process-group checkpoint transport, the Lighthouse
server, the store client. Four private hooks, each pinned by a test (tests/ft/test_protocol.py,
tests/ft/test_lighthouse.py):

* ``manager_server_bound_to``: torchft's Manager hard-codes its ManagerServer bind to ``[::]:port`` (every
  interface); rlfw replaces the module's ``ManagerServer`` name for the Manager's construction by a factory that
  binds the configured host.
* ``manager_replica_id``: 0.2.0 has no accessor for the replica id a Manager registered; rank 0 publishes it in the
  cell's store under ``REPLICA_ID_KEY``.
* ``quorum_epoch``: the Manager's quorum id is the private ``_quorum_id``.
* ``parse_heartbeats``: the Lighthouse's heartbeats are only on its ``/status`` page (0.2.0's template).

``ReconfigurableGloo`` is the seam of a process group that acts when a quorum (re)configures it. torchft 0.2.0
calls ``configure(store_addr, replica_id, rank, world_size, ...)``; its next release (``torchft-nightly``
2026.10.26) calls ``reconfigure(ReconfigureOptions)`` with the members' handles instead. A subclass overrides
``_before_configure`` and ``_configured(store_addr, rank, world_size)``, never either entry point, so it works
under both (``make test-torchft-nightly`` runs the protocol tests against the nightly).
"""

from __future__ import annotations

import contextlib
import re
from typing import Dict

import torchft.manager as _tft_manager
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupNCCL, create_store_client

__all__ = ["LighthouseServer", "Manager", "PGTransport", "ProcessGroupGloo", "ProcessGroupNCCL",
           "ReconfigurableGloo", "create_store_client", "manager_replica_id", "manager_server_bound_to",
           "parse_heartbeats", "quorum_epoch"]

# One line per replica on the Lighthouse's /status page (torchft 0.2.0's templates/status.html), e.g.
# ``cell_1:4f0c...: seen 0.0123s ago``.
_HEARTBEAT = re.compile(r"^\s*(\S+): seen ([0-9.eE+-]+)s ago\s*$", re.MULTILINE)


@contextlib.contextmanager
def manager_server_bound_to(host: str):
    """While open, a Manager built in this process binds its ManagerServer to ``host`` (not every interface)."""
    original = _tft_manager.ManagerServer

    def factory(*args, bind: str, **kwargs):
        port = bind.rsplit(":", 1)[1]
        return original(*args, bind=f"{'[' + host + ']' if ':' in host else host}:{port}", **kwargs)

    _tft_manager.ManagerServer = factory
    try:
        yield
    finally:
        _tft_manager.ManagerServer = original


def manager_replica_id(store) -> str:
    """The replica id this cell's Manager registered with the Lighthouse (``cell_<id>:<uuid>``), from the cell's
    store, where rank 0's Manager publishes it for the other ranks."""
    return store.get(_tft_manager.REPLICA_ID_KEY).decode()


def quorum_epoch(manager: Manager) -> int:
    """The quorum id of the Manager's last quorum (-1 before the first): torchft keeps it only privately."""
    return int(manager._quorum_id)


def parse_heartbeats(status_page: str) -> Dict[str, float]:
    """Seconds since the Lighthouse last heard each replica id, from its ``/status`` page."""
    return {replica: float(age) for replica, age in _HEARTBEAT.findall(status_page)}


class ReconfigurableGloo(ProcessGroupGloo):
    """torchft's Gloo group with one hook pair for a new quorum, under either torchft API."""

    def _before_configure(self) -> None:
        """Before the group is configured for a new quorum (release what the last one held)."""

    def _configured(self, store_addr: str, rank: int, world_size: int) -> None:
        """The group is configured: ``store_addr`` (``host:port/prefix``, unique per quorum and group rank),
        this member's ``rank`` among ``world_size``."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id=None,
                  group_rank=None, group_world_size=None, global_ranks=None) -> None:  # torchft 0.2.0
        self._before_configure()
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                          global_ranks)
        self._configured(store_addr, rank, world_size)

    def reconfigure(self, opts):  # torchft's next API
        from torchft.process_group import _rendezvous

        self._before_configure()
        work = super().reconfigure(opts)
        where = _rendezvous(opts, self._handle_id())
        self._configured(where.store_addr, where.rank, where.world_size)
        return work
