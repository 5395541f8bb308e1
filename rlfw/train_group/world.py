"""World: the Ray actors of one torch.distributed world (a classic DP world or one cell) and how to call them."""

from __future__ import annotations

import time
from typing import Any, List, Optional, Sequence

import ray
from ray.exceptions import RayActorError
from omegaconf import OmegaConf
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlfw.cluster.labels import parse_labels
from rlfw.train_group.placement import spread_selector
from rlfw.train_group.worker import TrainerWorker, resolve_device

STORE_TIMEOUT_S = 300.0  # a new rank 0's first call: its process starts and imports torch and Megatron first


def get_all(refs: Sequence[ray.ObjectRef], timeout_s: Optional[float] = None) -> List[Any]:
    """``ray.get`` that raises the *first* failure at once instead of waiting on ranks stuck behind it, and
    ``TimeoutError`` when not all are done within ``timeout_s`` (None: no deadline)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise TimeoutError(f"{len(pending)} calls did not finish within {timeout_s} s")
        ray.get(ready)
    return ray.get(list(refs))


class World:
    def __init__(self, cfg, world_size: int, vocab_size: int, cell: Optional[int], sync_factory, incarnation: int = 0,
                 role: str = "actor", load_from: Optional[str] = None, heals: bool = False):
        """``load_from``: the checkpoint its ranks start from; ``heals``: they take a live peer's state instead."""
        self.cfg, self.world_size, self.vocab_size, self.cell = cfg, world_size, vocab_size, cell
        self.incarnation, self.role = incarnation, role
        self.load_from, self.heals = load_from, heals
        self.sync_factory = sync_factory
        self.tp = cfg.dp.tp
        self.workers: List[Any] = []
        self.pg = None
        self.bundle: dict = {}

    def rank_bundle(self) -> dict:
        """The Ray resources of one rank."""
        bundle = {"CPU": self.cfg.cluster.cpus_per_worker}
        if resolve_device(self.cfg).type == "cuda":
            bundle["GPU"] = self.cfg.cluster.gpus_per_worker  # a share < 1 puts several cells on one GPU
        return bundle

    def place(self, avoid_nodes: Sequence[str] = ()) -> ray.ObjectRef:
        """Ask Ray for the world's resources, one bundle per rank: a cell's on one node (``STRICT_PACK``: a cell
        never spans nodes), off ``avoid_nodes`` where an alive node outside them is large enough (``placement``); a
        classic world's packed but free to span nodes, as any Megatron job. Returns the placement group's ready
        ref. Nothing waits here: the request stays pending until the cluster has room."""
        self.bundle = self.rank_bundle()
        selector = spread_selector(avoid_nodes, self.bundle, self.world_size,
                                   parse_labels(self.cfg.cluster.trainer_label_selector))
        self.pg = placement_group([self.bundle] * self.world_size,
                                  strategy="PACK" if self.cell is None else "STRICT_PACK",
                                  bundle_label_selector=selector)
        return self.pg.ready()

    def create_actors(self) -> ray.ObjectRef:
        """Once placed: create the actors; returns the ref of rank 0's store address (its process starts first)."""
        cfg = OmegaConf.to_container(self.cfg, resolve=True)
        self.workers = [
            TrainerWorker.options(
                num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
                name=None,
            ).remote(cfg, rank, self.world_size, self.vocab_size, self.cell, self.incarnation, self.role,
                     self.load_from, self.heals)
            for rank in range(self.world_size)
        ]
        return self.workers[0].serve_store.remote()

    def set_up(self, store_address) -> List[ray.ObjectRef]:
        """Every rank joins the world at rank 0's store; returns the refs of their set-up calls."""
        return [w.setup.remote(store_address, self.sync_factory) for w in self.workers]

    def start_actors(self) -> List[ray.ObjectRef]:
        """Create the actors and wait for rank 0's store; returns the set-up refs (await with ``get_all``)."""
        store = get_all([self.create_actors()], timeout_s=STORE_TIMEOUT_S)[0]
        return self.set_up(store)

    def launch(self, placement_timeout_s: float = 60.0) -> List[ray.ObjectRef]:
        """Place and create the actors, waiting at most ``placement_timeout_s`` for room; returns the set-up refs."""
        ready, _ = ray.wait([self.place()], timeout=placement_timeout_s)
        if not ready:
            raise RuntimeError(
                f"cannot place {self.world_size} trainer ranks of {self.bundle} within {placement_timeout_s:.0f} s: "
                f"the Ray cluster has {ray.available_resources()} free; lower cluster.cpus_per_worker or the "
                "number of replicas"
            )
        return self.start_actors()

    def start(self) -> None:
        get_all(self.launch())

    def leaders_group(self, replica: int) -> List[Any]:
        """The TP ranks of replica ``replica``."""
        return self.workers[replica * self.tp:(replica + 1) * self.tp]

    def call_leaders(self, method: str, *args, timeout_s: Optional[float] = None) -> List[Any]:
        """Call ``method`` on every rank (TP ranks compute together); return the replica leaders' results
        (``TimeoutError`` past ``timeout_s``)."""
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return get_all(refs, timeout_s)[:: self.tp]

    def call_by_replica(self, method: str, args_per_replica: Sequence[tuple],
                        timeout_s: Optional[float] = None) -> List[Any]:
        refs = [getattr(w, method).remote(*args_per_replica[rank // self.tp]) for rank, w in enumerate(self.workers)]
        return get_all(refs, timeout_s)[:: self.tp]

    def dead_ranks(self, timeout_s: float = 30.0) -> List[int]:
        """The ranks whose actor is dead, by asking each for its cursor: a dead actor's call fails as soon as Ray
        knows of the death. Returns at the first dead rank found (ranks stuck in a collective behind it may never
        answer), or an empty list when all answered or ``timeout_s`` passed."""
        refs = {w.committed.remote(): rank for rank, w in enumerate(self.workers)}
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            dead = []
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError:
                    dead.append(refs[ref])
            if dead:
                return dead
        return []

    def shutdown(self, graceful: bool = True) -> None:
        if graceful and self.workers:
            try:
                get_all([w.shutdown.remote() for w in self.workers], timeout_s=10)
            except Exception:  # a dead or stuck rank: it is killed below either way
                pass
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
