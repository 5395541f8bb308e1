"""ClassicGroup: all data-parallel replicas in one torch.distributed world, gradients reduced by Megatron DDP.

The baseline rlfw's cells are measured against: one failed rank fails the whole world.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Optional

import ray
import torch.distributed as dist
from ray.exceptions import RayActorError, RayTaskError

from rlfw.ft.agreement import verify_agreement
from rlfw.ft.errors import WorldLostError
from rlfw.train_group.deadlines import PhaseDeadlines
from rlfw.train_group.world import World, get_all


class ClassicSync:
    """Megatron DDP's SUM all-reduce of the grad buffers (calculate_per_token_loss: no averaging)."""

    replica_id = None  # no Lighthouse: a failed rank fails the world

    def __init__(self, worker):
        from megatron.core import parallel_state

        self.worker = worker
        self.ps = parallel_state

    def begin_step(self):
        return self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()

    def expect(self, call) -> None:
        assert call["replicas"] == self.ps.get_data_parallel_world_size()

    def require_state(self, meta) -> None:
        pass  # one world: every rank holds the state or the run is over

    def restore(self, optimizer_steps: int) -> None:
        pass  # Megatron DDP keeps no step count of its own

    def reduce_and_commit(self, part):
        self.worker.faults.maybe_fault("during_allreduce", part.meta["step"])  # its peers are entering it
        self.worker.trainer.model.finish_grad_sync()
        group = self.ps.get_data_parallel_group()
        ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

        def allreduce(tensor, op):
            dist.all_reduce(tensor, op=ops[op], group=group)
            return tensor

        verify_agreement(part, self.ps.get_data_parallel_world_size(), allreduce, device=self.worker.device)
        return True, {}

    def shutdown(self) -> None:
        pass


def ends_on_death(call):
    """A dead or hung rank ends the world's call with WorldLostError, naming the way on (``resume=auto``). The
    first error the driver sees may be a survivor's (its collective's peer closed the connection) rather than the
    dead actor's: then the world is probed, and the survivor's error stands only when every rank is alive. A call
    past its phase's deadline (``PhaseDeadlines``: a stalled rank, or one stuck outside any collective) ends the
    world the same way, within ``ft.stall_timeout_s`` more (the probe that names a dead rank)."""

    def lost(name: str, cause: str, what: str = "died") -> WorldLostError:
        return WorldLostError(
            f"a rank of the classic world {what} in {name} ({cause}): classic DP cannot go on without it; run the "
            "same command with resume=auto to continue from the last checkpoint, or use dp=cells to survive it")

    @functools.wraps(call)
    def wrapped(self, *args, **kwargs):
        try:
            return call(self, *args, **kwargs)
        except RayActorError as e:
            raise lost(call.__name__, str(e).splitlines()[0]) from e
        except RayTaskError as e:  # (before TimeoutError: a worker's own TimeoutError arrives as both)
            dead = self.world.dead_ranks()
            if not dead:
                raise
            raise lost(call.__name__, f"rank {', '.join(map(str, dead))} dead; a survivor saw "
                                      f"{type(e.cause).__name__}: {str(e.cause).splitlines()[0][:200]}") from e
        except TimeoutError as e:  # the call's deadline passed at the driver
            # A stalled rank never answers the probe: it is given the stall timeout, not the probe's default.
            dead = self.world.dead_ranks(timeout_s=self.world.cfg.ft.stall_timeout_s)
            cause = f"rank {', '.join(map(str, dead))} dead" if dead else str(e)
            raise lost(call.__name__, cause, "died" if dead else "hung or stalled") from e

    return wrapped


class ClassicGroup:
    """rlfw.train_group.group.TrainGroup over one world of ``dp.size`` replicas: every replica holds the state."""

    def __init__(self, cfg, vocab_size: int, role: str = "actor", load_from: Optional[str] = None):
        self.cfg, self.vocab_size, self.role = cfg, vocab_size, role
        self.num_replicas = cfg.dp.size
        self.metric_prefix = "dp" if role == "actor" else "critic_dp"
        self.world = self._start(load_from)
        self.deadlines = PhaseDeadlines(cfg.ft)

    def _start(self, load_from: Optional[str]) -> World:
        world = World(self.cfg, self.cfg.dp.size * self.cfg.dp.tp, self.vocab_size, cell=None,
                      sync_factory=ClassicSync, role=self.role, load_from=load_from)
        world.start()
        return world

    def _timed(self, phase: str, call):
        """``call(deadline_s)``, its duration recorded for the next call of ``phase``. A classic deadline ends the
        whole world, so it is never shorter than ``ft.first_call_timeout_s``: a call whose work grows (a larger
        batch, a slower disk) is waited for, and only a rank that hangs is not."""
        started = time.monotonic()
        result = call(max(self.deadlines(phase), self.cfg.ft.first_call_timeout_s))
        self.deadlines.record(phase, time.monotonic() - started)
        return result

    def replica_ids(self) -> List[int]:
        return list(range(self.num_replicas))

    def state_holder_ids(self) -> List[int]:
        return self.replica_ids()

    def restore(self, load_from: Optional[str]) -> None:
        """A new world from the checkpoint ``load_from``, as a restarted job would start it."""
        self.world.shutdown()
        self.world = self._start(load_from)
        self.deadlines.reset()

    @ends_on_death
    def await_replacements(self) -> None:
        """A classic world is restarted as a whole, from a checkpoint: no replacement joins it during a run."""

    @ends_on_death
    def compute_logprobs(self, batch, parts: List[List[int]]) -> List[Dict[str, Any]]:
        """Replica r computes log-probs of ``parts[r]``; returns one result per replica."""
        return self._timed("logprobs", lambda deadline_s: self.world.call_by_replica(
            "compute_logprobs", [(batch, p) for p in parts], timeout_s=deadline_s))

    @ends_on_death
    def train(self, minibatches) -> Dict[int, List[Dict[str, Any]]]:
        """Per replica, the stats of each committed optimizer step."""
        results = self._timed("train", lambda deadline_s: self.world.call_leaders(
            "train", minibatches, {"id": 0, "replicas": self.num_replicas}, timeout_s=deadline_s))
        return dict(enumerate(results))

    @ends_on_death
    def export_weights(self) -> ray.ObjectRef:
        """Replica 0's TP ranks gather the full weights together; rank 0's copy goes to the engines (a reference:
        the driver waits for the export's success only, ``TrainerWorker.export_weights``)."""
        calls = [w.export_weights.remote() for w in self.world.leaders_group(0)]  # [weights, done] per rank
        self._timed("weight_sync", lambda deadline_s: get_all([done for _, done in calls], deadline_s))
        return calls[0][0]

    @ends_on_death
    def save(self, path: str, step: int) -> None:
        """Every rank joins Megatron's distributed save; each shard is written once (by data-parallel rank 0)."""
        self._timed("save", lambda deadline_s: get_all([w.save.remote(path, step) for w in self.world.workers],
                                                      deadline_s))

    @ends_on_death
    def minibatches_committed(self, step: int) -> int:
        cursor = self._timed("committed", lambda deadline_s: get_all([self.world.workers[0].committed.remote()],
                                                                     deadline_s))[0]
        return cursor["minibatch_index"] + 1 if cursor["rl_step"] == step else 0

    @ends_on_death
    def weights_digests(self) -> Dict[int, str]:
        return dict(enumerate(self._timed("verify", lambda deadline_s: self.world.call_leaders(
            "weights_digest", timeout_s=deadline_s))))

    def step_info(self) -> Dict[str, float]:
        return {}

    def drain_events(self) -> List[Dict[str, Any]]:
        return []  # a classic world has no membership events: any failure ends the run

    def shutdown(self) -> None:
        self.world.shutdown()
