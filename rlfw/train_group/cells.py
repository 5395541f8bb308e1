"""CellGroup: every data-parallel replica an independent Megatron world (a *cell*), gradients through torchft.

The driver-side half of the cell protocol. It keeps each cell's state machine, fans calls out to the alive cells,
and never waits on a dead one: a cell is failed as a unit, fenced and reaped when its actor dies, its call raises,
its heartbeat stops for ``ft.stall_timeout_s`` (stalled, partitioned, its host gone) or its call runs past the
phase's deadline (a multiple of that phase's measured time: slow is not dead). A replacement is started when
resources allow and heals from a live peer in its first quorum. The worker-side half (quorum, split, all-reduce,
vote) is ``rlfw.ft.cell_sync``; the decisions both halves share are ``rlfw.ft.membership``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from rlfw.cluster.address import node_address
from rlfw.ft.cell_sync import CellSync
from rlfw.ft.errors import BelowMinCellsError, FatalError, JobError, StateLostError
from rlfw.ft.lighthouse import Lighthouse, heartbeat_ages
from rlfw.ft.membership import Membership
from rlfw.train_group.placement import node_ip, node_of
from rlfw.train_group.replacements import ReplacementPolicy
from rlfw.train_group.deadlines import PhaseDeadlines
from rlfw.train_group.world import STORE_TIMEOUT_S, World, get_all

log = logging.getLogger("rlfw.cells")
HEARTBEAT_POLL_S = 0.5  # how often a call's pending cells' heartbeats are read from the Lighthouse


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


class CellGroup:
    def __init__(self, cfg, vocab_size: int, role: str = "actor", load_from: Optional[str] = None):
        """``role=critic``: PPO's value model, in cells of its own with their own Lighthouse (critic cell i pairs
        with actor cell i; a replacement keeps its cell id, so the pairing survives a heal). ``load_from``: the
        checkpoint the first cells start from (None: the init weights)."""
        self.cfg, self.vocab_size, self.role = cfg, vocab_size, role
        self.metric_prefix = "cell" if role == "actor" else "critic_cell"
        self.events: List[Dict[str, Any]] = []  # failures, joins, heals, quorum changes; drained by the loop
        ft = cfg.ft
        self.lighthouse, self.lighthouse_address = start_lighthouse(cfg, role)
        self.membership = Membership(node_address(cfg.cluster))
        self.call: Optional[int] = None  # the membership id of the train call under way
        self.stranded: set = set()  # cells left waiting in a quorum that cannot form (the job ends below min_cells)
        self.call_members: set = set()  # the cells counted in it
        self.deadlines = PhaseDeadlines(cfg.ft)
        self.cells: Dict[int, Cell] = {}
        self.quorum_id: Optional[int] = None
        self.failures = 0
        self.policy = ReplacementPolicy(ft.replace_failed, ft.max_replacements, ft.replacement_backoff_s)
        self.scheduled: Dict[int, Tuple[float, int]] = {}  # cell id -> (start not before, incarnation)
        self._start_cells(load_from, incarnations={cell_id: 0 for cell_id in range(cfg.dp.num_cells)})

    def _start_cells(self, load_from: Optional[str], incarnations: Dict[int, int]) -> None:
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
        self.scheduled.clear()
        for cell in self.cells.values():
            if cell.state is not CellState.ERRORED:
                self.membership.fence(cell.id, cell.incarnation)
                cell.fail("restored from the last checkpoint: no live cell held the trained state")
        self.deadlines.reset()  # the restored cells' first calls warm up again
        self._start_cells(load_from, {cell_id: cell.incarnation + 1 for cell_id, cell in self.cells.items()})

    def _start_up(self, cell: "Cell", deadline: float, past: CellState, once: bool = False) -> None:
        """Poll a first cell until it has left state ``past`` (PLACING: placed; ALLOCATED: alive); ``once``: poll
        it once (its errors and the deadline checked), whatever its state."""
        while True:
            self._poll(cell)
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

    def _poll(self, cell: Cell) -> bool:
        """Advance ``cell`` (placed, set up), with an event for each step a replacement takes; whether it is alive."""
        before = cell.state
        try:
            state = cell.poll()
        except (RayActorError, RayTaskError, TimeoutError) as e:
            self._fail(cell, f"set-up failed: {e}")
            return False
        if before is CellState.PLACING and state is not CellState.PLACING:
            self._event("cell_placed", cell=cell.id, incarnation=cell.incarnation, node=cell.node)
        replacement = cell.world.heals
        if replacement and before is CellState.PLACING and state is not CellState.PLACING:
            self.policy.on_started()
            self._event("cell_replacement_started", cell=cell.id, incarnation=cell.incarnation)
        if replacement and before is not CellState.ALIVE and state is CellState.ALIVE:
            self._event("cell_joined", cell=cell.id, incarnation=cell.incarnation)
        return state is CellState.ALIVE

    def _fail(self, cell: Cell, reason: str, phase: str = "unknown", call_elapsed_s: float = 0.0) -> None:
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
        self._event("cell_failed", cell=cell.id, incarnation=cell.incarnation, phase=phase, reason=reason[:300],
                    detected_at=time.time(), call_elapsed_s=call_elapsed_s)
        self._event("cell_fenced", cell=cell.id, incarnation=cell.incarnation)
        not_before = self.policy.on_failure(cell.id)
        if not_before is not None:
            self.scheduled[cell.id] = (not_before, cell.incarnation + 1)
        elif self.cfg.ft.replace_failed:
            self._event("replacement_budget_spent", cell=cell.id, incarnation=cell.incarnation,
                        max_replacements=self.cfg.ft.max_replacements,
                        alive=sum(c.state is CellState.ALIVE for c in self.cells.values()))

    def _start_due_replacements(self) -> None:
        """Replacements whose backoff is over ask Ray for their resources (``placement_pending`` until placed)."""
        now = time.monotonic()
        for cell_id, (not_before, incarnation) in list(self.scheduled.items()):
            if now >= not_before:
                del self.scheduled[cell_id]
                self.cells[cell_id] = self._new_cell(cell_id, incarnation)
                self._event("placement_pending", cell=cell_id, incarnation=incarnation)

    def replacements_coming(self) -> bool:
        """Whether a replacement is scheduled, waiting for room, or setting up."""
        return bool(self.scheduled) or any(
            c.state in (CellState.PLACING, CellState.ALLOCATED) for c in self.cells.values())

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, **fields})

    def drain_events(self) -> List[Dict[str, Any]]:
        for cell_id, incarnation, where in self.membership.new_rejections():
            self._event("rejected", cell=cell_id, incarnation=incarnation, where=where)
        events, self.events = self.events, []
        return events

    def alive_cells(self) -> List[Cell]:
        """Cells taking part in the next call, after starting due replacements and promoting the ready ones."""
        self._start_due_replacements()
        for cell in list(self.cells.values()):
            if cell.state in (CellState.PLACING, CellState.ALLOCATED):
                self._poll(cell)
        return [c for c in sorted(self.cells.values(), key=lambda c: c.id) if c.state is CellState.ALIVE]

    def _require_cells(self, current_only: bool = False, minimum: Optional[int] = None) -> List[Cell]:
        """The alive cells (only those holding the trained state, with ``current_only``), waiting for
        replacements up to the deadline when fewer than ``minimum`` (default ft.min_cells) are alive."""
        minimum = self.cfg.ft.min_cells if minimum is None else minimum
        deadline = time.monotonic() + self.cfg.ft.replacement_deadline_s
        if current_only and not any(c.current for c in self.cells.values()
                                    if c.state not in (CellState.ERRORED, CellState.STOPPED)):
            raise StateLostError("every cell holding the trained state died; a replacement has nobody to heal from")
        while len(alive := [c for c in self.alive_cells() if c.current or not current_only]) < minimum:
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

    def replica_count(self) -> int:
        """Replicas for the log-prob shares: the cells holding the trained state."""
        return len(self._require_cells(current_only=True))

    def replica_ids(self) -> List[int]:
        return [c.id for c in self._require_cells()]

    # ---------------------------------------------------------------------------------------------- calls
    def _stalled(self, cell_ids) -> Dict[int, float]:
        """{cell id: seconds since its heartbeat} for the cells the Lighthouse has not heard for ft.stall_timeout_s.
        If the Lighthouse cannot be read, nobody is declared stalled (the phase deadline still applies)."""
        try:
            ages = heartbeat_ages(self.lighthouse_address)
        except OSError as e:
            log.warning("cannot read heartbeats from the Lighthouse at %s: %s", self.lighthouse_address, e)
            return {}
        return {cid: ages[rid] for cid in cell_ids
                if (rid := self.cells[cid].replica_id) in ages and ages[rid] > self.cfg.ft.stall_timeout_s}

    def _fan_out(self, calls: Dict[int, Callable[[Cell], List[ray.ObjectRef]]], phase: str,
                 deadline_s: Optional[float] = None, every_rank: bool = False) -> Dict[int, Any]:
        """Run one call per cell; returns {cell id: leader's result} (``every_rank``: the list of every rank's, in
        rank order) for the cells that finished.

        A cell is failed when its call raises, its actor dies, its result is lost with its node, its heartbeat stops for ft.stall_timeout_s, or the
        call runs past ``deadline_s`` (default: the phase's measured deadline). A cell merely slower than its peers
        is waited for. An error of the job (``OSError``: the disk) stops the run: on a survivor it would recur.
        """
        deadline_s = self.deadlines(phase) if deadline_s is None else deadline_s
        pending = {}
        for cell_id, make_refs in calls.items():
            pending[cell_id] = make_refs(self.cells[cell_id])
        started = time.monotonic()  # failures report how far into the call they were noticed
        results: Dict[int, Any] = {}
        next_heartbeat_check = started + HEARTBEAT_POLL_S
        while pending:
            ray.wait([r for rs in pending.values() for r in rs], num_returns=1, timeout=0.05)  # until progress
            for cell_id, rs in list(pending.items()):
                done, _ = ray.wait(rs, num_returns=len(rs), timeout=0)
                failed = None
                for ref in done:
                    try:
                        ray.get(ref)
                    except RayTaskError as e:
                        if isinstance(e.cause, FatalError):
                            raise e.cause from e
                        if isinstance(e.cause, OSError):
                            raise JobError(f"{phase} failed on cell {cell_id}: {type(e.cause).__name__}: "
                                           f"{e.cause}") from e
                        failed = str(e)
                        break
                    except RayActorError as e:
                        failed = str(e)
                        break
                    except ObjectLostError as e:  # answered, but its node was lost (cut off) before we fetched it
                        failed = f"its result was lost with its node: {str(e).splitlines()[0]}"
                        break
                if failed is not None:
                    del pending[cell_id]
                    self._fail(self.cells[cell_id], failed, phase, call_elapsed_s=time.monotonic() - started)
                elif len(done) == len(rs):
                    results[cell_id] = ray.get(rs) if every_rank else ray.get(rs[0])
                    self.deadlines.record(phase, time.monotonic() - started)
                    del pending[cell_id]
            if phase == "train" and pending and not results:
                self._rescue_below_min(calls, pending, started)
            now = time.monotonic()
            if pending and now >= next_heartbeat_check:
                next_heartbeat_check = now + HEARTBEAT_POLL_S
                for cell_id, age in self._stalled(pending).items():
                    del pending[cell_id]
                    self._fail(self.cells[cell_id], f"no heartbeat for {age:.1f} s, past ft.stall_timeout_s="
                               f"{self.cfg.ft.stall_timeout_s:g} (stalled, partitioned, or its host is gone)",
                               phase, call_elapsed_s=now - started)
            if pending and now - started > deadline_s:
                for cell_id in list(pending):
                    del pending[cell_id]
                    self._fail(self.cells[cell_id], f"still busy {now - started:.0f} s into the call, past the "
                               f"{phase} deadline of {deadline_s:.0f} s (its heartbeat goes on: slow or hung)",
                               phase, call_elapsed_s=now - started)
        return results

    def _rescue_below_min(self, calls, pending: Dict[int, List[ray.ObjectRef]], started: float) -> None:
        """Fewer than ft.min_cells cells left in a train call: the survivors' quorum cannot form until the failed
        cells' replacements join, so the call goes to each replacement as soon as it is ready. If none can come
        in time, stop now (BelowMinCellsError: the loop saves the survivors' state) instead of letting the
        survivors time out in their quorum."""
        if len(pending) >= self.cfg.ft.min_cells:
            return
        coming = self.replacements_coming()
        if not coming or time.monotonic() > started + self.cfg.ft.replacement_deadline_s:
            self.stranded = set(pending)  # their actors still answer save and committed (their state group)
            raise BelowMinCellsError(
                f"only {len(pending)} cells left in the step, below ft.min_cells={self.cfg.ft.min_cells}, and "
                + ("no replacement can come (ft.replace_failed is off or the ft.max_replacements="
                   f"{self.cfg.ft.max_replacements} are spent)" if not coming else
                   f"no replacement became ready within ft.replacement_deadline_s={self.cfg.ft.replacement_deadline_s}")
            )
        for cell in self.alive_cells():
            if cell.id in calls and cell.id not in pending:
                self.call_members.add(cell.id)
                self.membership.join(self.call)  # counted before it is sent: its peers wait for it
                pending[cell.id] = calls[cell.id](cell)

    def await_replacements(self) -> None:
        """Up to ft.await_replacement_s for the replacements under way (scheduled, placing, setting up); the driver
        calls it as a step begins, so that they take part in the step's split and heal in its quorum."""
        if self.cfg.ft.await_replacement_s <= 0:
            return
        deadline = time.monotonic() + self.cfg.ft.await_replacement_s
        while self.replacements_coming() and time.monotonic() < deadline:
            self.alive_cells()
            time.sleep(0.05)

    def compute_logprobs(self, batch, parts: List[List[int]]) -> List[Dict[str, Any]]:
        """Share ``i`` goes to the i-th alive cell; a share whose cell dies is recomputed by a survivor."""
        results: List[Optional[Dict[str, Any]]] = [None] * len(parts)
        while (todo := [i for i, r in enumerate(results) if r is None]):
            cells = self._require_cells(current_only=True)  # a replacement that has not healed has stale weights
            assignment = {cells[k % len(cells)].id: [] for k in range(min(len(todo), len(cells)))}
            for k, i in enumerate(todo):
                assignment[cells[k % len(cells)].id].append(i)
            calls = {
                cid: (lambda c, shares=shares: [
                    w.compute_logprobs.remote(batch, [j for i in shares for j in parts[i]]) for w in c.world.workers])
                for cid, shares in assignment.items()
            }
            for cid, out in self._fan_out(calls, "logprobs").items():
                offset = 0
                for i in assignment[cid]:
                    n = len(parts[i])
                    results[i] = {k: v[offset:offset + n] for k, v in out.items()}
                    offset += n
        return results

    def train(self, minibatches) -> Dict[int, List[Dict[str, Any]]]:
        """Every alive cell runs the step protocol on the same minibatches; returns the survivors' stats."""
        cells = self._require_cells()
        self.call, self.call_members = self.membership.open_call(len(cells)), {c.id for c in cells}
        call = {"id": self.call, "replicas": len(cells), "deadline_s": self.deadlines("train")}
        calls = {c.id: (lambda c: [w.train.remote(minibatches, call) for w in c.world.workers]) for c in cells}
        try:
            results = self._fan_out(calls, "train")
        finally:
            self.call_members = set()
        if not results:
            raise StateLostError("every cell failed during the step; nothing was committed")
        for cell_id in results:
            self.cells[cell_id].current = True  # it committed with its peers: healed if it needed to
            self.policy.on_committed(cell_id)
        retried: Dict[int, Dict[str, Any]] = {}
        for steps in results.values():
            for s in steps:
                if s["attempts"] > 1 and s["attempts"] > retried.get(s["minibatch_index"], {}).get("attempts", 0):
                    retried[s["minibatch_index"]] = s
        for mb, s in sorted(retried.items()):  # a discarded step redone on a fresh split of the same data
            self._event("resplit", minibatch=mb, attempts=s["attempts"], participants=s["num_replicas"])
        for cell_id, steps in results.items():
            for s in steps:
                if s.get("heal_time") is not None:
                    self._event("heal", cell=cell_id, heal_time=s["heal_time"], quorum_id=s["quorum_id"])
                if self.quorum_id != s["quorum_id"]:
                    self._event("quorum_change", old=self.quorum_id, new=s["quorum_id"],
                                  participants=s["num_replicas"])
                    self.quorum_id = s["quorum_id"]
        return results

    def _on_writer(self, phase: str, call: Callable[[Any, Cell], ray.ObjectRef]) -> Tuple[List[Any], Cell]:
        """Run ``call(worker, writer)`` on every rank of the writer (the first alive cell holding the trained state);
        if the writer fails (dies, stalls, or does not answer within ft.writer_timeout_s), run it again on the next
        such cell. An error of the job (the disk: ``OSError``) stops the run at once (``_fan_out``). Returns the
        refs and the writer that answered."""
        while True:
            writer = self._require_cells(current_only=True, minimum=1)[0]
            refs = [call(w, writer) for w in writer.world.workers]
            done = self._fan_out({writer.id: lambda _: refs}, phase, deadline_s=self.cfg.ft.writer_timeout_s)
            if writer.id in done:
                return refs, writer
            self._event("writer_failover", cell=writer.id, phase=phase)

    def export_weights(self) -> ray.ObjectRef:
        """Full weights from the writer cell, for the rollout engines: a reference to its leader's copy. The driver
        waits for each rank's small success return alone (``TrainerWorker.export_weights``)."""
        weights: Dict[int, ray.ObjectRef] = {}  # id(worker handle) -> its weights, per attempt

        def export(worker, _) -> ray.ObjectRef:
            weights[id(worker)], done = worker.export_weights.remote()
            return done

        _, writer = self._on_writer("weight_sync", export)
        return weights[id(writer.world.workers[0])]

    def save(self, path: str, step: int) -> None:
        """The writer writes into a directory of its own incarnation, moved to ``path`` once it answered: a writer
        that was failed over but still runs (a stall outlived, a partition) never touches its successor's files."""
        target = Path(path)

        def own(cell: Cell) -> Path:
            return target.parent / f".{target.name}.writer-{cell.id}-{cell.incarnation}"

        _, writer = self._on_writer("checkpoint_save", lambda w, cell: w.save.remote(str(own(cell)), step))
        shutil.rmtree(target, ignore_errors=True)  # a save of this step that an earlier job never finished
        os.replace(own(writer), target)
        for stray in target.parent.glob(f".{target.name}.writer-*"):  # failed-over writers' leftovers
            shutil.rmtree(stray, ignore_errors=True)

    def minibatches_committed(self, step: int) -> int:
        """How many of RL step ``step``'s minibatches the cells holding the trained state committed (their
        cursor): what a save in the middle of the step holds."""
        writer = self._require_cells(current_only=True, minimum=1)[0]
        cursor = get_all([writer.world.workers[0].committed.remote()], timeout_s=self.cfg.ft.writer_timeout_s)[0]
        return cursor["minibatch_index"] + 1 if cursor["rl_step"] == step else 0

    def weights_digests(self) -> Dict[int, str]:
        """Per cell, one SHA-256 over every rank's digest in rank order: equal iff every TP shard is equal. A cell
        that dies, stalls or hangs here is failed like in any other call (the phase's deadline), not waited for."""
        cells = self._require_cells(current_only=True)
        per_rank = self._fan_out({c.id: lambda c: [w.weights_digest.remote() for w in c.world.workers]
                                  for c in cells}, "verify", every_rank=True)
        if not per_rank:
            raise RuntimeError("no cell answered the weight check: every cell failed in it (see the cell_failed "
                               "events)")
        return {cell_id: hashlib.sha256("".join(ranks).encode()).hexdigest() for cell_id, ranks in per_rank.items()}

    def step_info(self) -> Dict[str, float]:
        return {"cells/alive": len(self.alive_cells()),
                "ft/quorum_id": self.quorum_id if self.quorum_id is not None else -1,
                "ft/failures": self.failures, "ft/replacements": self.policy.started}

    def shutdown(self) -> None:
        for cell in self.cells.values():
            cell.stop(graceful=cell.id not in self.stranded)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
