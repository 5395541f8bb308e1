"""CellSync with real torchft and no Megatron: one single-rank cell per spawned process, a two-layer MLP as trainer.

Each cell is its own process because rlfw.ft.manager's ManagerServer bind patch is process-global, and because a
fault kills the process (a real SIGKILL from rlfw.ft.faults). The pytest process runs the Lighthouse and plays the
driver: it sends each cell ``(op, *args)`` over a Pipe (no lock a killed writer could leave held) and reads the
replies under a deadline. ``Cell.train`` is TrainerWorker._train_minibatch without Ray, Megatron or timings.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import time
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np
import psutil
import torch
from omegaconf import OmegaConf

from rlfw.cluster.store import serve_store
from rlfw.config.schema import ClusterConfig, FaultConfig, FTConfig
from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch, split_batch
from rlfw.ft.cell_sync import CellSync
from rlfw.ft.faults import FaultInjector
from rlfw.ft.lighthouse import Lighthouse

HOST = "127.0.0.1"
# heartbeat 2 s: a cell starved of CPU on a loaded 2-core machine must not look dead; collectives 4 s: a peer that
# died is usually seen at once (its sockets close), a live peer stuck behind it only at this timeout.
FT = dict(min_cells=1, heartbeat_timeout_s=2.0, join_timeout_s=0.5, quorum_timeout_s=30.0, collective_timeout_s=4.0)
SAMPLES_PER_STEP = 8
READY_TIMEOUT_S = 120.0  # spawn + torch/torchft import of several processes at once on 2 loaded cores
STEP_TIMEOUT_S = 60.0  # a step with a death: heartbeat expiry, a collective timeout, the join wait, the retry


def minibatch(step: int) -> RolloutBatch:
    """RL step ``step``'s one minibatch: 8 samples whose response lengths differ (so num_tokens means something)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(SAMPLES_PER_STEP, 4, generator=gen), torch.randn(SAMPLES_PER_STEP, generator=gen)
    samples = {
        "sample_id": [100 * step + i for i in range(SAMPLES_PER_STEP)],
        "tokens": [[1] * (2 + i % 3) for i in range(SAMPLES_PER_STEP)],
        "prompt_len": [1] * SAMPLES_PER_STEP,
        "x": x.tolist(),
        "y": y.tolist(),
    }
    [mb] = RolloutBatch(samples).minibatches(0)  # sets the dynamic global batch size and minibatch_index 0
    mb.meta["step"] = step
    return mb


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

    def forward_backward(self, part: RolloutBatch) -> None:
        """Squared error summed over this share, over the whole minibatch's sample count: the cells' SUM of
        gradients is then the gradient of the minibatch's mean loss, whatever the split."""
        x, y = torch.tensor(part.samples["x"]), torch.tensor(part.samples["y"])
        loss = ((self.model.module(x).squeeze(-1) - y) ** 2).sum() / part.meta[DYNAMIC_GBS]["num_samples"]
        loss.backward()

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


def reference(parts_per_step: List[int]) -> List[Dict[str, Any]]:
    """One process, no torchft: step s sums the gradients of its minibatch's ``parts_per_step[s]`` strided parts,
    each computed on its own as a cell would. Returns, per step, the summed gradient and the state after it."""
    trainer = TinyTrainer()
    out = []
    for step, num_parts in enumerate(parts_per_step):
        assert num_parts <= 2, "with more addends the summation order is Gloo's own"
        grads = []
        for part in split_batch(minibatch(step), num_parts, "strided"):
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
        ft, cluster = OmegaConf.structured(FTConfig(**FT)), OmegaConf.structured(ClusterConfig(host=HOST, device="cpu"))
        self.cfg = OmegaConf.create({"ft": ft, "cluster": cluster})
        self.cell, self.incarnation = spec["cell"], spec["incarnation"]
        self.rank, self.world_size, self.host = 0, 1, HOST
        fault = OmegaConf.structured(FaultConfig(**spec["fault"]))
        self.faults = FaultInjector(fault, spec["run_dir"], self.cell, self.rank, self.incarnation)
        self.cursor = {"rl_step": -1, "minibatch_index": -1, "optimizer_steps": 0}
        self.trainer = TinyTrainer()
        seed = 1000 * self.incarnation + self.cell  # RNG streams differ per process: a heal must carry them
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.store = serve_store(HOST)
        before = listening()
        self.sync = CellSync(self, spec["lighthouse"])
        self.probe = {"manager_server": sorted(listening() - before), "quorum_id": self.sync.quorum_id}

    def train(self, step: int, expect: int) -> Dict[str, Any]:
        """Attempts until one commits, each recorded: its quorum, rank, the state right after begin_step, the
        sample ids it trained, the vote; a committed one also the reduced gradient and the state after it."""
        self.sync.expect(expect)
        mb, attempts = minibatch(step), []
        while True:
            rank, num_participants = self.sync.begin_step()
            attempt = {"quorum_id": self.sync.quorum_id, "rank": rank, "num_participants": num_participants,
                       "after_begin": snapshot(self.trainer, self.cursor)}
            attempts.append(attempt)
            part = split_batch(mb, num_participants, "strided")[rank]
            self.sync.require_state(part.meta)
            self.cursor.update(rl_step=step, minibatch_index=part.meta["minibatch_index"])
            self.faults.maybe_die("before_forward", step)
            self.trainer.zero_grad()
            self.trainer.forward_backward(part)
            committed, info = self.sync.reduce_and_commit(part)
            grads = self.trainer.grad_buffers()[0]
            attempt.update(committed=committed, info=info, sample_ids=list(part.sample_ids), grads=_numpy(grads))
            if committed:
                self.trainer.optimizer_step()
                self.cursor["optimizer_steps"] += 1
                return {"attempts": attempts, "after": snapshot(self.trainer, self.cursor)}

    def listening(self) -> List[tuple]:
        return sorted(listening())


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
    """A Lighthouse in this process and the cell processes joined through it; ``close`` kills what is left."""

    def __init__(self, run_dir, fault: Optional[Dict[str, Any]] = None):
        self.run_dir, self.fault = str(run_dir), fault or {}
        self.lighthouse = Lighthouse(HOST, 0, FT["min_cells"], FT["join_timeout_s"], FT["heartbeat_timeout_s"])
        self.ctx = mp.get_context("spawn")
        self.processes: List[CellProcess] = []

    def spawn(self, *cells: int, incarnation: int = 0) -> List[CellProcess]:
        """Start the cells together and return once each has its Manager (heartbeating to the Lighthouse)."""
        new = [CellProcess(self.ctx, {"cell": c, "incarnation": incarnation, "lighthouse": self.lighthouse.address,
                                      "run_dir": self.run_dir, "fault": self.fault}) for c in cells]
        self.processes += new
        deadline = time.monotonic() + READY_TIMEOUT_S
        for proc in new:
            proc.probe = proc.receive(deadline)
            assert proc.probe is not None, f"{proc} died while starting (exit code {proc.exitcode})"
        return new

    def call(self, cells: List[CellProcess], op: str, *args, timeout_s: float = STEP_TIMEOUT_S) -> List[Any]:
        """Send ``op`` to every cell at once (as the driver dispatches a step), then collect; None for the dead."""
        for proc in cells:
            proc.conn.send((op, *args))
        deadline = time.monotonic() + timeout_s
        return [proc.receive(deadline) for proc in cells]

    def train(self, cells: List[CellProcess], step: int) -> List[Optional[Dict[str, Any]]]:
        return self.call(cells, "train", step, len(cells))

    def close(self) -> None:
        for proc in self.processes:
            proc.kill()
        self.lighthouse.shutdown()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
