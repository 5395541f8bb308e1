"""A cell: one Megatron world of TP x PP ranks, its actors, and its state machine.

PLACING (its resources asked of Ray; it waits there until the cluster has room) -> ALLOCATED (actors placed,
Megatron and torchft setting up) -> ALIVE (takes part in steps) -> ERRORED (failed: every actor killed and reaped)
or STOPPED (shut down cleanly). ``poll`` advances it without ever blocking, so the driver goes on with the alive
cells while a replacement is placed and set up.
"""

from __future__ import annotations

import enum
import functools
import time
from typing import List, Optional, Sequence

import ray

from rlfw.ft.cell_sync import CellSync
from rlfw.train_group.placement import node_ip, node_of
from rlfw.train_group.world import STORE_TIMEOUT_S, World


class CellState(enum.Enum):
    PLACING = "placing"  # its resources are requested from Ray; it waits there until the cluster has room
    ALLOCATED = "allocated"  # actors placed, Megatron and torchft setting up
    ALIVE = "alive"  # takes part in steps
    ERRORED = "errored"  # failed; its actors are killed and reaped
    STOPPED = "stopped"  # shut down cleanly


class Cell:
    """One Megatron world of TP x PP ranks with its own store, actors and torchft replica id."""

    def __init__(self, cell_id: int, cfg, vocab_size: int, lighthouse_address: str, membership_address,
                 incarnation: int, role: str = "actor", avoid_nodes: Sequence[str] = (), load_from: Optional[str] = None,
                 heals: bool = False):
        """``heals``: a replacement, which takes the trained state from a live peer in its first quorum; otherwise
        the cell starts from ``load_from`` (a checkpoint) or the init weights."""
        self.id, self.incarnation = cell_id, incarnation
        self.world = World(
            cfg, cfg.dp.tp * cfg.dp.pp, vocab_size, cell=cell_id,
            sync_factory=functools.partial(CellSync, lighthouse_address=lighthouse_address,
                                           membership_address=membership_address),
            incarnation=incarnation, role=role, load_from=load_from, heals=heals,
        )
        self.replica_id: Optional[str] = None  # its Manager's name at the Lighthouse, once set up
        self.placement = self.world.place(avoid_nodes)  # nothing waits: pending until Ray has room
        self.state = CellState.PLACING
        self.node_id: Optional[str] = None  # the Ray node it was placed on, and that node's address
        self.node: Optional[str] = None
        self.store_ref: Optional[ray.ObjectRef] = None  # rank 0's store address, once its process has started
        self.placed_at = 0.0
        self.setup_refs: List[ray.ObjectRef] = []
        self.error: Optional[str] = None
        # Holds the job's trained state: true from the start for a cell that loads it (identical initial weights
        # or checkpoint), and for a replacement only once it healed from a peer and committed a step.
        self.current = not heals

    def poll(self) -> CellState:
        """PLACING -> ALLOCATED once Ray placed it (its actors are created then), ALLOCATED -> ALIVE once every rank
        finished set-up; a failed set-up raises. Never blocks: the driver goes on with the alive cells meanwhile."""
        if self.state is CellState.PLACING and ray.wait([self.placement], timeout=0)[0]:
            self.node_id = node_of(self.world.pg)
            self.node = node_ip(self.node_id)
            self.store_ref, self.placed_at = self.world.create_actors(), time.monotonic()
            self.state = CellState.ALLOCATED
        if self.state is CellState.ALLOCATED and not self.setup_refs:
            if ray.wait([self.store_ref], timeout=0)[0]:
                self.setup_refs = self.world.set_up(ray.get(self.store_ref))
            elif time.monotonic() - self.placed_at > STORE_TIMEOUT_S:
                raise TimeoutError(f"rank 0 of cell {self.id} did not start within {STORE_TIMEOUT_S:.0f} s")
        if self.state is CellState.ALLOCATED and self.setup_refs:
            ready, _ = ray.wait(self.setup_refs, num_returns=len(self.setup_refs), timeout=0)
            if len(ready) == len(self.setup_refs):
                self.replica_id = ray.get(self.setup_refs)[0]  # raises if a rank failed
                self.state = CellState.ALIVE
        return self.state

    def fail(self, reason: str) -> None:
        """Kill and reap every actor of the cell: a partial cell is never left running."""
        self.error = reason
        self.state = CellState.ERRORED
        self.world.shutdown(graceful=False)

    def stop(self, graceful: bool = True) -> None:
        """``graceful``: ask its ranks to close their process groups first (not for a cell whose call never ends)."""
        if self.state in (CellState.ALIVE, CellState.ALLOCATED, CellState.PLACING):
            self.world.shutdown(graceful=graceful and self.state is not CellState.PLACING)
        self.state = CellState.STOPPED
