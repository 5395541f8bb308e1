"""CellSync with real torchft and no Megatron: one single-rank cell per spawned process, a two-layer MLP as trainer.

Each cell is its own process because rlfw.ft.manager's ManagerServer bind patch is process-global, and because a
fault kills or stops the process (a real SIGKILL or SIGSTOP from rlfw.ft.faults). The pytest process runs the
Lighthouse and the Membership store and plays the driver: it sends each cell ``(op, *args)`` over a Pipe (no lock a
killed writer could leave held), reads the replies under a deadline, and takes a cell out of the call (fence +
leave) when its process dies or, with ``watch_heartbeats``, when the Lighthouse has not heard it for
``stall_timeout_s`` -- the driver's own rules (``rlfw.train_group.detector``), without Ray. ``Cell.train`` runs the
worker's own minibatch loop (``rlfw.train_group.minibatches.train_minibatches``, every fault point included) with a
model-free trainer, recording every attempt through a wrapping sync.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np
import psutil
import torch
from omegaconf import OmegaConf

import forked

from rlfw.cluster.store import serve_store
from rlfw.config.schema import ClusterConfig, FaultConfig, FTConfig, SplitConfig
from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch, split_batch
from rlfw.ft.cell_sync import CellSync
from rlfw.ft.faults import FaultInjector
from rlfw.ft.lighthouse import Lighthouse, heartbeat_ages
from rlfw.ft.membership import Membership
from rlfw.train_group.detector import FailureDetector
from rlfw.train_group.minibatches import train_minibatches

HOST = "127.0.0.1"
# heartbeat 2 s: a cell starved of CPU on a loaded 2-core machine must not look dead; collectives 4 s: a peer that
# died is usually seen at once (its sockets close), a live peer stuck behind it only at this timeout.
# stall 4 s: past a loaded machine's scheduling hiccups, short enough that a stalled cell costs a test seconds.
FT = dict(min_cells=1, heartbeat_timeout_s=2.0, join_timeout_s=0.5, quorum_timeout_s=30.0, collective_timeout_s=4.0,
          stall_timeout_s=4.0, min_phase_timeout_s=30.0)
SAMPLES_PER_STEP = 8
MICROBATCH = 2  # samples per micro-batch of TinyTrainer: a cell's share of 4 samples runs as two
READY_TIMEOUT_S = 120.0  # spawn + torch/torchft import of several processes at once on 2 loaded cores
STRIDED = OmegaConf.structured(SplitConfig(name="delayed"))  # split at train time, strided: what a cell does
STEP_TIMEOUT_S = 60.0  # a step with a death: heartbeat expiry, a collective timeout, the join wait, the retry


def minibatch(step: int, samples: int = SAMPLES_PER_STEP) -> RolloutBatch:
    """RL step ``step``'s one minibatch: 8 samples whose response lengths differ (so num_tokens means something)."""
    [mb] = minibatches(step, 1, samples)
    return mb


def minibatches(step: int, count: int, samples: int = SAMPLES_PER_STEP) -> List[RolloutBatch]:
    """RL step ``step``'s ``samples`` samples as ``count`` minibatches (optimizer steps) of samples / count each."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(samples, 4, generator=gen), torch.randn(samples, generator=gen)
    columns = {
        "sample_id": [1000 * step + i for i in range(samples)],
        "tokens": [[1] * (2 + i % 3) for i in range(samples)],
        "prompt_len": [1] * samples,
        "x": x.tolist(),
        "y": y.tolist(),
    }
    out = RolloutBatch(columns).minibatches(samples // count)  # sets each one's gbs and minibatch_index
    for mb in out:
        mb.meta["step"] = step
    return out


class TinyTrainer:
    """The part of a Megatron trainer CellSync touches: ``model.module``, an optimizer, a device, and gradients in
    one flat buffer (Megatron DDP's grad buffer) that every parameter's ``.grad`` is a view of."""

    def __init__(self):
        torch.manual_seed(0)  # every cell starts from the same weights (make_manager: init_sync=False)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.model = SimpleNamespace(module=module)
        params = list(module.parameters())
        self._grads = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:  # backward accumulates into an existing .grad in place, so the views stay the storage
            p.grad = self._grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer = torch.optim.Adam(params, lr=0.05)
        self.device = torch.device("cpu")

    def grad_buffers(self) -> List[torch.Tensor]:
        return [self._grads]

    def zero_grad(self) -> None:
        self._grads.zero_()  # in place: optimizer.zero_grad() would set .grad to None and break the views

    def forward_backward(self, part: RolloutBatch, on_microbatch=None) -> Dict[str, float]:
        """Squared error summed over this share, over the whole minibatch's sample count: the cells' SUM of
        gradients is then the gradient of the minibatch's mean loss, whatever the split. Micro-batches of
        ``MICROBATCH`` samples, ``on_microbatch(i)`` before each (as Megatron's schedule runs a trainer's)."""
        x, y = torch.tensor(part.samples["x"]), torch.tensor(part.samples["y"])
        total = part.meta[DYNAMIC_GBS]["num_samples"]
        for i, start in enumerate(range(0, len(part), MICROBATCH)):
            if on_microbatch is not None:
                on_microbatch(i)
            rows = slice(start, start + MICROBATCH)
            loss = ((self.model.module(x[rows]).squeeze(-1) - y[rows]) ** 2).sum() / total
            loss.backward()
        return {}

    def optimizer_step(self) -> None:
        self.optimizer.step()


def _numpy(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().numpy().copy()
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_numpy(v) for v in tree]
    return tree


def rng_digest() -> str:
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    digest.update(np.random.get_state()[1].tobytes())
    digest.update(repr(random.getstate()).encode())
    return digest.hexdigest()


def snapshot(trainer: TinyTrainer, cursor: Dict[str, int]) -> Dict[str, Any]:
    """Everything a heal must carry, as numpy (tensors sent through a Pipe would go through shared memory)."""
    return {"weights": _numpy(trainer.model.module.state_dict()), "optimizer": _numpy(trainer.optimizer.state_dict()),
            "cursor": dict(cursor), "rng": rng_digest()}


def assert_bitwise_equal(a, b, path: str = "") -> None:
    """Equal bytes everywhere (not merely close); the message names the first place that differs."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        if a.tobytes() != b.tobytes():
            raise AssertionError(f"{path} differs: max |a - b| = {np.abs(a.astype(float) - b).max():.3g}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} vs {sorted(b)}"
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def reference(parts_per_step: List[int], per_step: int = 1) -> List[Dict[str, Any]]:
    """One process, no torchft: optimizer step k sums the gradients of its minibatch's ``parts_per_step[k]``
    strided parts, each computed on its own as a cell would (``per_step`` minibatches per RL step). Returns, per
    optimizer step, the summed gradient and the state after it."""
    trainer = TinyTrainer()
    out = []
    for k, num_parts in enumerate(parts_per_step):
        assert num_parts <= 2, "with more addends the summation order is Gloo's own"
        grads = []
        for part in split_batch(minibatches(k // per_step, per_step)[k % per_step], num_parts, "strided"):
            trainer.zero_grad()
            trainer.forward_backward(part)
            grads.append(trainer.grad_buffers()[0].clone())
        total = grads[0] if num_parts == 1 else grads[0] + grads[1]  # two addends: the order cannot matter
        trainer.grad_buffers()[0].copy_(total)
        trainer.optimizer_step()
        out.append({"grads": _numpy(total), **snapshot(trainer, {})})
    return out


def listening() -> set:
    """(ip, port) of every socket this process listens on."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


# ------------------------------------------------------------------------------------------------ in the cell
class Cell:
    """A single-rank cell: the host CellSync expects (rlfw.ft.protocol.SyncHost), without Ray or Megatron."""

    def __init__(self, spec: Dict[str, Any]):
        # The run's schemas with their defaults, so keys CellSync starts to read later exist here too.
        ft = OmegaConf.structured(FTConfig(**spec["ft"]))
        cluster = OmegaConf.structured(ClusterConfig(host=HOST, device="cpu"))
        self.cfg = OmegaConf.create({"ft": ft, "cluster": cluster})
        self.cell, self.incarnation = spec["cell"], spec["incarnation"]
        self.heals = self.incarnation > 0
        self.samples_per_step = spec["samples_per_step"]
        self.rank, self.world_size, self.host = 0, 1, HOST
        fault = OmegaConf.structured(FaultConfig(**spec["fault"]))
        self.faults = FaultInjector(fault, spec["run_dir"], self.cell, self.rank, self.incarnation)
        self.cursor = {"rl_step": -1, "minibatch_index": -1, "optimizer_steps": 0}
        self.state_lock = threading.Lock()
        self.trainer = TinyTrainer()
        seed = 1000 * self.incarnation + self.cell  # RNG streams differ per process: a heal must carry them
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.store = serve_store(HOST)
        before = listening()
        self.sync = CellSync(self, spec["lighthouse"], spec["membership"])
        self.probe = {"manager_server": sorted(listening() - before), "quorum_id": self.sync.quorum_id,
                      "replica_id": self.sync.replica_id}

    def train(self, step: int, per_step: int, call: Dict[str, Any]) -> Dict[str, Any]:
        """The worker's loop over RL step ``step``'s ``per_step`` minibatches. Every attempt is recorded: its
        quorum, rank, the state right after begin_step, the minibatch and sample ids it trained, the vote; a
        committed one also the reduced gradient. Returns the attempts, the committed records and the final state."""
        sync = RecordingSync(self.sync, self)
        records = train_minibatches(sync, self, minibatches(step, per_step, self.samples_per_step), call, STRIDED)
        return {"attempts": sync.attempts, "records": records, "after": snapshot(self.trainer, self.cursor),
                "joins": self.sync.joins}

    def listening(self) -> List[tuple]:
        return sorted(listening())

    def transport(self) -> Dict[str, Any]:
        """What the cross-cell all-reduces went over (ft.host_transport)."""
        pg = self.sync.manager._pg
        return {"backend": pg.getBackendName(), "shared_allreduces": getattr(pg, "shared_allreduces", 0),
                "fallback_reason": getattr(pg, "fallback_reason", None)}


class RecordingSync:
    """CellSync as train_call sees it, recording each attempt on the way (the harness's only addition)."""

    def __init__(self, sync: CellSync, cell: Cell):
        self.sync, self.cell, self.attempts = sync, cell, []

    def expect(self, call):
        self.sync.expect(call)

    def begin_step(self):
        t0 = time.perf_counter()
        rank, num_participants = self.sync.begin_step()
        self.attempts.append({"quorum_id": self.sync.quorum_id, "rank": rank, "num_participants": num_participants,
                              "join_s": time.perf_counter() - t0,
                              "after_begin": snapshot(self.cell.trainer, self.cell.cursor)})
        return rank, num_participants

    def require_state(self, meta):
        self.sync.require_state(meta)

    def reduce_and_commit(self, part):
        committed, info = self.sync.reduce_and_commit(part)
        self.attempts[-1].update(committed=committed, info=info, sample_ids=list(part.sample_ids),
                                 minibatch_index=part.meta["minibatch_index"],
                                 grads=_numpy(self.cell.trainer.grad_buffers()[0]))
        return committed, info


def cell_main(spec: Dict[str, Any], conn) -> None:
    torch.set_num_threads(1)
    try:
        cell = Cell(spec)
        conn.send(cell.probe)
        while True:
            op, *args = conn.recv()
            conn.send(getattr(cell, op)(*args))
    except EOFError:
        return  # the test process is gone
    except Exception:
        conn.send({"error": traceback.format_exc()})


# ---------------------------------------------------------------------------------------- in the test process
class CellProcess:
    def __init__(self, ctx, spec: Dict[str, Any]):
        self.cell, self.incarnation = spec["cell"], spec["incarnation"]
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=cell_main, args=(spec, child), daemon=True,
                                   name=f"cell_{self.cell}.{self.incarnation}")
        self.process.start()
        child.close()  # only the child holds its end: its death reads as EOF here
        self.probe: Optional[dict] = None

    def __repr__(self) -> str:
        return f"cell {self.cell} (incarnation {self.incarnation})"

    def receive(self, deadline: float) -> Optional[Any]:
        """The cell's next reply, or None if it died (``exitcode`` then says how)."""
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"{self} did not answer in time")
        try:
            reply = self.conn.recv()
        except EOFError:
            self.process.join(timeout=10)
            return None
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(f"{self} failed:\n{reply['error']}")
        return reply

    @property
    def exitcode(self) -> Optional[int]:
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)


class Cluster:
    """A Lighthouse and a Membership store in this process and the cell processes joined through them; ``close``
    kills what is left. ``ft`` overrides the harness's FT settings (``min_cells`` also configures the Lighthouse);
    ``samples_per_step``: the size of each RL step's batch (at least the cell count, so no cell gets an empty share)."""

    def __init__(self, run_dir, fault: Optional[Dict[str, Any]] = None, watch_heartbeats: bool = False,
                 samples_per_step: int = SAMPLES_PER_STEP, **ft):
        self.run_dir, self.fault, self.ft = str(run_dir), fault or {}, {**FT, **ft}
        self.samples_per_step = samples_per_step
        self.watch_heartbeats = watch_heartbeats
        self.lighthouse = Lighthouse(HOST, 0, self.ft["min_cells"], self.ft["join_timeout_s"],
                                     self.ft["heartbeat_timeout_s"])
        self.membership = Membership(HOST)
        self.ctx = forked.context()
        self.processes: List[CellProcess] = []
        self.taken_out: List[CellProcess] = []  # in the order the driver decided

    def spawn(self, *cells: int, incarnation: int = 0, timeout_s: float = READY_TIMEOUT_S) -> List[CellProcess]:
        """Start the cells together and return once each has its Manager (heartbeating to the Lighthouse)."""
        new = [CellProcess(self.ctx, {"cell": c, "incarnation": incarnation, "lighthouse": self.lighthouse.address,
                                      "membership": self.membership.address, "run_dir": self.run_dir,
                                      "fault": self.fault, "ft": self.ft,
                                      "samples_per_step": self.samples_per_step}) for c in cells]
        self.processes += new
        deadline = time.monotonic() + timeout_s
        for proc in new:
            proc.probe = proc.receive(deadline)
            assert proc.probe is not None, f"{proc} died while starting (exit code {proc.exitcode})"
        return new

    def call(self, cells: List[CellProcess], op: str, *args, timeout_s: float = STEP_TIMEOUT_S) -> List[Any]:
        """Send ``op`` to every cell at once, then collect; None for the dead."""
        for proc in cells:
            proc.conn.send((op, *args))
        deadline = time.monotonic() + timeout_s
        return [proc.receive(deadline) for proc in cells]

    def train(self, cells: List[CellProcess], step: int, per_step: int = 1, timeout_s: float = STEP_TIMEOUT_S
              ) -> List[Optional[Dict[str, Any]]]:
        return self.dispatch(cells, step, per_step).collect(timeout_s)

    def dispatch(self, cells: List[CellProcess], step: int, per_step: int = 1) -> "TrainCall":
        call = TrainCall(self, step, per_step, self.membership.open_call(len(cells)))
        for proc in cells:
            call.send(proc)
        return call

    def take_out(self, proc: CellProcess, call: int) -> None:
        """The driver's decision: fence the incarnation and stop its peers waiting for it."""
        self.membership.fence(proc.cell, proc.incarnation)
        self.membership.leave(call)
        self.taken_out.append(proc)

    def close(self) -> None:
        for proc in self.processes:
            proc.kill()
        self.lighthouse.shutdown()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrainCall:
    """One train call under way: ``send`` sends it to one of the cells it was opened for, ``add`` to one more (a
    rescue: counted in the membership first), ``collect`` waits for every cell under the driver's rules."""

    def __init__(self, cluster: Cluster, step: int, per_step: int, call_id: int):
        self.cluster, self.step, self.per_step, self.id = cluster, step, per_step, call_id
        self.cells: List[CellProcess] = []

    def add(self, proc: CellProcess) -> None:
        self.cluster.membership.join(self.id)
        self.send(proc)

    def send(self, proc: CellProcess) -> None:
        self.cells.append(proc)
        proc.conn.send(("train", self.step, self.per_step, {"id": self.id, "replicas": len(self.cells)}))

    def collect(self, timeout_s: float = STEP_TIMEOUT_S) -> List[Optional[Dict[str, Any]]]:
        """Each cell's reply; None for one that died or was taken out as stalled (its process then lives on) under
        the driver's own failure rules (``FailureDetector``; past ``timeout_s`` the test fails instead)."""
        deadline = time.monotonic() + timeout_s
        detector = FailureDetector("train", timeout_s, OmegaConf.structured(FTConfig(**self.cluster.ft)))
        replies: Dict[int, Optional[Dict[str, Any]]] = {}
        while len(replies) < len(self.cells):
            if time.monotonic() > deadline:
                raise TimeoutError(f"call {self.id}: no reply from {[p for i, p in enumerate(self.cells) if i not in replies]}")
            for i, proc in enumerate(self.cells):
                if i in replies:
                    continue
                if proc.conn.poll(0.02):
                    replies[i] = proc.receive(deadline)
                    if replies[i] is None:
                        self.cluster.take_out(proc, self.id)
                elif not proc.process.is_alive():
                    replies[i] = None
                    self.cluster.take_out(proc, self.id)
            if self.cluster.watch_heartbeats:
                pending = {i: proc.probe["replica_id"] for i, proc in enumerate(self.cells) if i not in replies}
                for i in detector.stalled(pending, heartbeat_ages(self.cluster.lighthouse.address)):
                    replies[i] = None
                    self.cluster.take_out(self.cells[i], self.id)
        return [replies[i] for i in range(len(self.cells))]
