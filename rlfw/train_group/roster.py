"""The cells of a train group over the run: started, failed (fenced, then reaped), replaced, restored.

A failed cell is fenced at the membership store before it is killed, so one the kill does not reach (a partition)
still takes part in nothing, and it leaves the train call under way, so its peers stop waiting for it. Its
replacement (``rlfw.train_group.replacements`` says when) is placed when Ray has room and joins the next call once
alive; every change is an event, which the loop logs.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

import ray
from ray.exceptions import RayActorError, RayTaskError

from rlfw.ft.errors import BelowMinCellsError, StateLostError
from rlfw.ft.membership import Membership
from rlfw.train_group.cell import Cell, CellState
from rlfw.train_group.replacements import ReplacementPolicy

log = logging.getLogger("rlfw.cells")


class Roster:
    """``role``'s cells, joining the Lighthouse at ``lighthouse_address``; the first ones start from ``load_from``
    (a checkpoint; None: the init weights) and are alive when the roster is made."""

    def __init__(self, cfg, vocab_size: int, role: str, lighthouse_address: str, membership_host: str,
                 load_from: Optional[str] = None):
        self.cfg, self.vocab_size, self.role, self.lighthouse_address = cfg, vocab_size, role, lighthouse_address
        ft = cfg.ft
        self.membership = Membership(membership_host)
        self.cells: Dict[int, Cell] = {}
        self.events: List[Dict[str, Any]] = []  # failures, joins, heals, quorum changes; drained by the loop
        self.failures = 0
        self.policy = ReplacementPolicy(ft.replace_failed, ft.max_replacements, ft.replacement_backoff_s)
        self.call: Optional[int] = None  # the membership id of the train call under way
        self.call_members: set = set()  # the cells counted in it
        self.stranded: set = set()  # cells left waiting in a quorum that cannot form (the job ends below min_cells)
        self.start(load_from, incarnations={cell_id: 0 for cell_id in range(cfg.dp.num_cells)})

    def start(self, load_from: Optional[str], incarnations: Dict[int, int]) -> None:
        """Start every cell from ``load_from`` (or the init weights) and wait until all are alive."""
        deadline = time.monotonic() + self.cfg.ft.replacement_deadline_s
        for cell_id, incarnation in incarnations.items():
            self.cells[cell_id] = self._new_cell(cell_id, incarnation, load_from=load_from, heals=False)
            if self.cfg.cluster.cell_placement == "spread":  # the next cell avoids this one's node: it must be known
                self._start_up(self.cells[cell_id], deadline, CellState.PLACING)
        self._start_up_all(deadline)

    def restore(self, load_from: Optional[str]) -> None:
        """Every holder of the trained state died: fail what is left (replacements that had nobody to heal from),
        then start every cell afresh from the checkpoint ``load_from`` (None: the init weights), as a restarted job
        would, but without leaving the process."""
        self.policy.clear()
        for cell in self.cells.values():
            if cell.state is not CellState.ERRORED:
                self.membership.fence(cell.id, cell.incarnation)
                cell.fail("restored from the last checkpoint: no live cell held the trained state")
        self.start(load_from, {cell_id: cell.incarnation + 1 for cell_id, cell in self.cells.items()})

    def _start_up(self, cell: "Cell", deadline: float, past: CellState, once: bool = False) -> None:
        """Poll a first cell until it has left state ``past`` (PLACING: placed; ALLOCATED: alive); ``once``: poll
        it once (its errors and the deadline checked), whatever its state."""
        while True:
            self.poll(cell)
            if cell.state is CellState.ERRORED:
                raise RuntimeError(f"cell {cell.id} failed during start-up: {cell.error}")
            if cell.state is CellState.ALIVE or (past is CellState.PLACING and cell.state is not past):
                return
            if time.monotonic() > deadline:
                why = "its set-up did not finish"
                if cell.state is CellState.PLACING:
                    why = (f"Ray could not place it (free: {ray.available_resources()}); lower "
                           "cluster.cpus_per_worker or the number of replicas")
                raise TimeoutError(f"cell {cell.id} not ready within ft.replacement_deadline_s="
                                   f"{self.cfg.ft.replacement_deadline_s}: {why}")
            if once:
                return
            time.sleep(0.05)

    def _start_up_all(self, deadline: float) -> None:
        """Poll every first cell until all are alive: their set-ups (imports, worlds, models) run side by side."""
        while True:
            for cell in self.cells.values():
                if cell.state is not CellState.ALIVE:
                    self._start_up(cell, deadline, CellState.ALLOCATED, once=True)
            if all(cell.state is CellState.ALIVE for cell in self.cells.values()):
                return
            time.sleep(0.05)

    # ------------------------------------------------------------------------------------------ membership
    def _new_cell(self, cell_id: int, incarnation: int, load_from: Optional[str] = None, heals: bool = True) -> Cell:
        occupied = []
        if self.cfg.cluster.cell_placement == "spread":
            occupied = [c.node_id for c in self.cells.values()
                        if c.node_id and c.state in (CellState.ALLOCATED, CellState.ALIVE)]
        return Cell(cell_id, self.cfg, self.vocab_size, self.lighthouse_address, self.membership.address,
                    incarnation, self.role, avoid_nodes=occupied, load_from=load_from, heals=heals)

    def open_call(self, cells: List[Cell]) -> int:
        """A train call to ``cells`` begins: its membership id, which counts them (their peers wait for them)."""
        self.call, self.call_members = self.membership.open_call(len(cells)), {c.id for c in cells}
        return self.call

    def join_call(self, cell: Cell) -> None:
        """A replacement joins the call under way: counted before it is sent the call."""
        self.call_members.add(cell.id)
        self.membership.join(self.call)

    def close_call(self) -> None:
        self.call_members = set()

    def committed(self, cell_id: int) -> None:
        """The cell committed with its peers: it holds the trained state (healed if it needed to)."""
        self.cells[cell_id].current = True
        self.policy.on_committed(cell_id)

    def poll(self, cell: Cell) -> bool:
        """Advance ``cell`` (placed, set up), with an event for each step a replacement takes; whether it is alive."""
        before = cell.state
        try:
            state = cell.poll()
        except (RayActorError, RayTaskError, TimeoutError) as e:
            self.fail(cell, f"set-up failed: {e}")
            return False
        if before is CellState.PLACING and state is not CellState.PLACING:
            self.event("cell_placed", cell=cell.id, incarnation=cell.incarnation, node=cell.node)
        replacement = cell.world.heals
        if replacement and before is CellState.PLACING and state is not CellState.PLACING:
            self.policy.on_started()
            self.event("cell_replacement_started", cell=cell.id, incarnation=cell.incarnation)
        if replacement and before is not CellState.ALIVE and state is CellState.ALIVE:
            self.event("cell_joined", cell=cell.id, incarnation=cell.incarnation)
        return state is CellState.ALIVE

    def fail(self, cell: Cell, reason: str, phase: str = "unknown", call_elapsed_s: float = 0.0) -> None:
        if cell.state is CellState.ERRORED:
            return
        self.failures += 1
        log.warning("cell %d failed in %s: %s", cell.id, phase, reason.splitlines()[0] if reason else "")
        # Fenced before it is killed: if the kill does not reach it (a partition), it still takes part in nothing.
        self.membership.fence(cell.id, cell.incarnation)
        if cell.id in self.call_members:
            self.call_members.discard(cell.id)
            self.membership.leave(self.call)  # its peers in the call stop waiting for it
        cell.fail(reason)
        self.event("cell_failed", cell=cell.id, incarnation=cell.incarnation, phase=phase, reason=reason[:300],
                    detected_at=time.time(), call_elapsed_s=call_elapsed_s)
        self.event("cell_fenced", cell=cell.id, incarnation=cell.incarnation)
        if not self.policy.schedule(cell.id, cell.incarnation + 1) and self.cfg.ft.replace_failed:
            self.event("replacement_budget_spent", cell=cell.id, incarnation=cell.incarnation,
                        max_replacements=self.cfg.ft.max_replacements,
                        alive=sum(c.state is CellState.ALIVE for c in self.cells.values()))

    def _start_due_replacements(self) -> None:
        """Replacements whose backoff is over ask Ray for their resources (``placement_pending`` until placed)."""
        for cell_id, incarnation in self.policy.due():
            self.cells[cell_id] = self._new_cell(cell_id, incarnation)
            self.event("placement_pending", cell=cell_id, incarnation=incarnation)

    def replacements_coming(self) -> bool:
        """Whether a replacement is scheduled, waiting for room, or setting up."""
        return self.policy.waiting() or any(
            c.state in (CellState.PLACING, CellState.ALLOCATED) for c in self.cells.values())

    def event(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, **fields})

    def drain_events(self) -> List[Dict[str, Any]]:
        for cell_id, incarnation, where in self.membership.new_rejections():
            self.event("rejected", cell=cell_id, incarnation=incarnation, where=where)
        events, self.events = self.events, []
        return events

    def alive(self) -> List[Cell]:
        """Cells taking part in the next call, after starting due replacements and promoting the ready ones."""
        self._start_due_replacements()
        for cell in list(self.cells.values()):
            if cell.state in (CellState.PLACING, CellState.ALLOCATED):
                self.poll(cell)
        return [c for c in sorted(self.cells.values(), key=lambda c: c.id) if c.state is CellState.ALIVE]

    def require(self, current_only: bool = False, minimum: Optional[int] = None) -> List[Cell]:
        """The alive cells (only those holding the trained state, with ``current_only``), waiting for
        replacements up to the deadline when fewer than ``minimum`` (default ft.min_cells) are alive."""
        minimum = self.cfg.ft.min_cells if minimum is None else minimum
        deadline = time.monotonic() + self.cfg.ft.replacement_deadline_s
        if current_only and not any(c.current for c in self.cells.values()
                                    if c.state not in (CellState.ERRORED, CellState.STOPPED)):
            raise StateLostError("every cell holding the trained state died; a replacement has nobody to heal from")
        while len(alive := [c for c in self.alive() if c.current or not current_only]) < minimum:
            if time.monotonic() > deadline or not self.replacements_coming():
                raise BelowMinCellsError(
                    f"only {len(alive)} cells alive, below ft.min_cells={self.cfg.ft.min_cells}, and "
                    + (f"no replacement became ready within ft.replacement_deadline_s="
                       f"{self.cfg.ft.replacement_deadline_s}" if self.replacements_coming() else
                       "no replacement can come (ft.replace_failed is off or the ft.max_replacements="
                       f"{self.cfg.ft.max_replacements} are spent)")
                )
            time.sleep(0.1)
        return alive
