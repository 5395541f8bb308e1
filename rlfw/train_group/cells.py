"""CellGroup: every data-parallel replica an independent Megatron world (a *cell*), gradients through torchft.

The driver-side half of the cell protocol: it fans each call out to the alive cells and never waits on a dead one.
Its parts, one module each: a cell's state machine (``cell``), the cells over the run -- started, failed, replaced
(``roster``), when a replacement comes (``replacements``), the failure rules (``detector``), the writer that exports
and saves with failover (``writer``), the events a train call reports (``train_events``). The worker-side half
(quorum, split, all-reduce, vote) is ``rlfw.ft.cell_sync``; the decisions both halves share are
``rlfw.ft.membership``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

from rlfw.cluster.address import node_address
from rlfw.ft.errors import BelowMinCellsError, StateLostError
from rlfw.ft.lighthouse import heartbeat_ages, start_lighthouse
from rlfw.train_group.cell import Cell
from rlfw.train_group.deadlines import PhaseDeadlines
from rlfw.train_group.detector import FailureDetector
from rlfw.train_group.roster import Roster
from rlfw.train_group.train_events import train_events
from rlfw.train_group.writer import Writer

log = logging.getLogger("rlfw.cells")


class CellGroup:
    def __init__(self, cfg, vocab_size: int, role: str = "actor", load_from: Optional[str] = None):
        """``role=critic``: PPO's value model, in cells of its own with their own Lighthouse (critic cell i pairs
        with actor cell i; a replacement keeps its cell id, so the pairing survives a heal). ``load_from``: the
        checkpoint the first cells start from (None: the init weights)."""
        self.cfg = cfg
        self.metric_prefix = "cell" if role == "actor" else "critic_cell"
        self.lighthouse, self.lighthouse_address = start_lighthouse(cfg, role)
        self.deadlines = PhaseDeadlines(cfg.ft)
        self.quorum_id: Optional[int] = None
        self.roster = Roster(cfg, vocab_size, role, self.lighthouse_address, node_address(cfg.cluster), load_from)
        self.writer = Writer(lambda: self.roster.require(current_only=True, minimum=1),
                             lambda phase, calls, deadline_s: self._fan_out(calls, phase, deadline_s),
                             self.roster.event, cfg.ft.writer_timeout_s)

    def restore(self, load_from: Optional[str]) -> None:
        """Every holder of the trained state died: every cell starts afresh from the checkpoint ``load_from`` (None:
        the init weights), as a restarted job would, but without leaving the process."""
        self.roster.restore(load_from)
        self.deadlines.reset()  # the restored cells' first calls warm up again

    def drain_events(self) -> List[Dict[str, Any]]:
        return self.roster.drain_events()

    def replica_ids(self) -> List[int]:
        """The cells the next train call goes to: every alive one (a replacement heals in the call's quorum)."""
        return [c.id for c in self.roster.require()]

    def state_holder_ids(self) -> List[int]:
        """The alive cells holding the trained state: those that compute log-probs and write."""
        return [c.id for c in self.roster.require(current_only=True)]

    # ---------------------------------------------------------------------------------------------- calls
    def _heartbeat_ages(self) -> Optional[Dict[str, float]]:
        """The Lighthouse's heartbeat ages by replica id; None (nobody stalled) when it cannot be read."""
        try:
            return heartbeat_ages(self.lighthouse_address)
        except OSError as e:
            log.warning("cannot read heartbeats from the Lighthouse at %s: %s", self.lighthouse_address, e)
            return None

    def _fan_out(self, calls: Dict[int, Callable[[Cell], List[ray.ObjectRef]]], phase: str,
                 deadline_s: Optional[float] = None, every_rank: bool = False) -> Dict[int, Any]:
        """Run one call per cell; returns {cell id: leader's result} (``every_rank``: the list of every rank's, in
        rank order) for the cells that finished. A cell is failed under the ``FailureDetector``'s rules (default
        deadline: the phase's measured one); a cell merely slower than its peers is waited for."""
        detector = FailureDetector(phase, self.deadlines(phase) if deadline_s is None else deadline_s, self.cfg.ft)
        pending = {cell_id: make_refs(self.roster.cells[cell_id]) for cell_id, make_refs in calls.items()}
        results: Dict[int, Any] = {}
        while pending:
            ray.wait([r for rs in pending.values() for r in rs], num_returns=1, timeout=0.05)  # until progress
            for cell_id, rs in list(pending.items()):
                done, _ = ray.wait(rs, num_returns=len(rs), timeout=0)
                try:
                    for ref in done:
                        ray.get(ref)
                except (RayTaskError, RayActorError, ObjectLostError) as e:
                    self._fail_pending({cell_id: detector.failure(cell_id, e)}, pending, phase, detector)
                    continue
                if len(done) == len(rs):
                    results[cell_id] = ray.get(rs) if every_rank else ray.get(rs[0])
                    self.deadlines.record(phase, detector.elapsed())
                    del pending[cell_id]
            if phase == "train" and pending and not results:
                self._rescue(detector, calls, pending)
            if pending and detector.heartbeat_due():
                replicas = {c: self.roster.cells[c].replica_id for c in pending}
                self._fail_pending(detector.stalled(replicas, self._heartbeat_ages()), pending, phase, detector)
            self._fail_pending(detector.overdue(pending), pending, phase, detector)
        return results

    def _fail_pending(self, failed: Dict[int, str], pending: Dict[int, Any], phase: str,
                      detector: FailureDetector) -> None:
        for cell_id, reason in failed.items():
            del pending[cell_id]
            self.roster.fail(self.roster.cells[cell_id], reason, phase, detector.elapsed())

    def _rescue(self, detector: FailureDetector, calls, pending: Dict[int, List[ray.ObjectRef]]) -> None:
        """Below ft.min_cells in a train call (``FailureDetector.rescue``): send the call to each replacement as
        soon as it is ready (counted in the membership first: its peers wait for it)."""
        try:
            if not detector.rescue(len(pending), self.roster.replacements_coming()):
                return
        except BelowMinCellsError:
            self.roster.stranded = set(pending)  # their actors still answer save and committed (their state group)
            raise
        for cell in self.roster.alive():
            if cell.id in calls and cell.id not in pending:
                self.roster.join_call(cell)
                pending[cell.id] = calls[cell.id](cell)

    def await_replacements(self) -> None:
        """Up to ft.await_replacement_s for the replacements under way (scheduled, placing, setting up); the driver
        calls it as a step begins, so that they take part in the step's split and heal in its quorum."""
        if self.cfg.ft.await_replacement_s <= 0:
            return
        deadline = time.monotonic() + self.cfg.ft.await_replacement_s
        while self.roster.replacements_coming() and time.monotonic() < deadline:
            self.roster.alive()
            time.sleep(0.05)

    def compute_logprobs(self, batch, parts: List[List[int]]) -> List[Dict[str, Any]]:
        """Share ``i`` goes to the i-th alive cell; a share whose cell dies is recomputed by a survivor."""
        results: List[Optional[Dict[str, Any]]] = [None] * len(parts)
        while (todo := [i for i, r in enumerate(results) if r is None]):
            cells = self.roster.require(current_only=True)  # a replacement that has not healed has stale weights
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
        cells = self.roster.require()
        call = {"id": self.roster.open_call(cells), "replicas": len(cells), "deadline_s": self.deadlines("train")}
        calls = {c.id: (lambda c: [w.train.remote(minibatches, call) for w in c.world.workers]) for c in cells}
        try:
            results = self._fan_out(calls, "train")
        finally:
            self.roster.close_call()
        if not results:
            raise StateLostError("every cell failed during the step; nothing was committed")
        for cell_id in results:
            self.roster.committed(cell_id)
        for event in train_events(results, self.quorum_id):
            self.quorum_id = event["new"] if event["kind"] == "quorum_change" else self.quorum_id
            self.roster.events.append(event)
        return results

    def export_weights(self) -> ray.ObjectRef:
        return self.writer.export_weights()

    def save(self, path: str, step: int) -> None:
        self.writer.save(path, step)

    def minibatches_committed(self, step: int) -> int:
        return self.writer.minibatches_committed(step)

    def weights_digests(self) -> Dict[int, str]:
        """Per cell, one SHA-256 over every rank's digest in rank order: equal iff every TP shard is equal. A cell
        that dies, stalls or hangs here is failed like in any other call (the phase's deadline), not waited for."""
        cells = self.roster.require(current_only=True)
        per_rank = self._fan_out({c.id: lambda c: [w.weights_digest.remote() for w in c.world.workers]
                                  for c in cells}, "verify", every_rank=True)
        if not per_rank:
            raise RuntimeError("no cell answered the weight check: every cell failed in it (see the cell_failed "
                               "events)")
        return {cell_id: hashlib.sha256("".join(ranks).encode()).hexdigest() for cell_id, ranks in per_rank.items()}

    def step_info(self) -> Dict[str, float]:
        return {"cells/alive": len(self.roster.alive()),
                "ft/quorum_id": self.quorum_id if self.quorum_id is not None else -1,
                "ft/failures": self.roster.failures, "ft/replacements": self.roster.policy.started}

    def shutdown(self) -> None:
        for cell in self.roster.cells.values():
            cell.stop(graceful=cell.id not in self.roster.stranded)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
