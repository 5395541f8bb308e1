"""Membership: the driver's decisions about which cells take part in a call, one value that every rank reads.

The Lighthouse forms a quorum from whoever asks in time; it cannot tell a cell that is slow (a long step, a GC
pause, a SIGSTOP, swapping) from one that is gone. So the cells of a train call wait for each other in begin_step
until the quorum holds exactly the cells the driver still counts in the call, and only the driver takes a cell
out: its actor died, its heartbeat stopped for ``ft.stall_timeout_s``, or a phase ran past its deadline. A cell
taken out is also *fenced*: if its process wakes (a stall outlived, a partition healed), it refuses to join any
quorum, so it can neither take a share of a step nor heal from a peer. Nothing of a failed incarnation counts.

The values live in a TCPStore served by the driver (on ``cluster.host``): per call, ``members`` (cells sent the
call, a rescue adds one) and ``gone`` (taken out since); per failed incarnation a fence key; ``rejected`` lists the
fenced incarnations that tried to take part after all, for the driver's events.
"""

from __future__ import annotations

from typing import List, Tuple

from rlfw.cluster.store import connect_store, serve_store


def _fence_key(cell: int, incarnation: int) -> str:
    return f"fenced/{cell}/{incarnation}"


class Membership:
    """The driver's side: serves the store and writes every decision."""

    def __init__(self, host: str, timeout_s: float = 60.0):
        self.store = serve_store(host, timeout_s)
        self.address = (host, self.store.port)
        self._calls = 0
        self._rejected_seen = 0

    def open_call(self, members: int) -> int:
        """A new call sent to ``members`` cells; returns its id (ranks read the call's values under it)."""
        self._calls += 1
        self.store.add(f"call/{self._calls}/members", members)
        return self._calls

    def join(self, call: int) -> None:
        """One more cell is sent ``call`` (a replacement rescuing a step below ft.min_cells)."""
        self.store.add(f"call/{call}/members", 1)

    def leave(self, call: int) -> None:
        """A cell of ``call`` is out: its peers stop waiting for it."""
        self.store.add(f"call/{call}/gone", 1)

    def fence(self, cell: int, incarnation: int) -> None:
        self.store.set(_fence_key(cell, incarnation), "1")

    def new_rejections(self) -> List[Tuple[int, int, str]]:
        """(cell, incarnation, where) of each fenced incarnation that tried to take part since the last call."""
        if not self.store.check(["rejected"]):
            return []
        entries = [e for e in self.store.get("rejected").decode().split(";") if e]
        new, self._rejected_seen = entries[self._rejected_seen:], len(entries)
        out = []
        for entry in new:
            cell, incarnation, where = entry.split(",", 2)
            out.append((int(cell), int(incarnation), where))
        return out


class MembershipView:
    """A rank's side: reads the driver's decisions (each read is one round trip to the driver's store)."""

    def __init__(self, address: Tuple[str, int], timeout_s: float = 60.0):
        self.store = connect_store(address[0], address[1], timeout_s)

    def expected(self, call: int) -> int:
        """Cells the driver still counts in ``call``: the quorum this call's steps wait for."""
        return self.store.add(f"call/{call}/members", 0) - self.store.add(f"call/{call}/gone", 0)

    def fenced(self, cell: int, incarnation: int) -> bool:
        return self.store.check([_fence_key(cell, incarnation)])

    def reject(self, cell: int, incarnation: int, where: str) -> None:
        self.store.append("rejected", f"{cell},{incarnation},{where};")
