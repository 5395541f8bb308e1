"""One trainer rank as a Ray actor: its torch.distributed world, Megatron state, and the per-step protocol.

A classic replica and a cell run the same worker; what differs is the ``GradSync`` (how replicas agree on the
step's gradient) and the world it belongs to (the whole DP group, or its own cell).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from contextlib import nullcontext
from typing import Any, Dict, List, Optional, Tuple

import ray
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from rlfw.cluster.address import node_address, pin_gloo_interface
from rlfw.cluster.store import connect_store, serve_store
from rlfw.config.devices import weights_on_device
from rlfw.data.batch import RolloutBatch
from rlfw.model.shape import ModelShape
from rlfw.train_group.minibatches import train_minibatches


def model_shape(cfg, vocab_size: int) -> ModelShape:
    m = cfg.model
    return ModelShape(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size, vocab_size=vocab_size,
        max_seq_len=m.max_seq_len, rope_theta=m.rope_theta, norm_epsilon=m.norm_epsilon, head_dim=m.head_dim,
        qkv_bias=m.qkv_bias, qk_layernorm=m.qk_layernorm, tie_word_embeddings=m.tie_word_embeddings,
        rope_scaling_factor=m.rope_scaling_factor,
    )


def fault_target(cfg, rank: int, world_size: int, cell: Optional[int]) -> Tuple[int, int, int]:
    """(cell, rank in it, its size) as ``fault.*`` names them: in a classic world the "cell" is the data-parallel
    replica (Megatron's rank order is tp, dp, pp), so ``fault.cell=1`` kills replica 1's first rank."""
    if cell is not None:
        return cell, rank, world_size
    tp, replicas = cfg.dp.tp, cfg.dp.size
    return (rank // tp) % replicas, rank % tp + tp * (rank // (tp * replicas)), world_size // replicas


def resolve_device(cfg) -> torch.device:
    if cfg.cluster.device == "cuda" or (cfg.cluster.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return torch.device("cpu")


# The state group runs beside the default one: a train call can be stuck in a quorum that will never form (a cell
# left below ft.min_cells) and torchft's wait cannot be cut short, yet the driver must still read the cursor and
# take the emergency save. ``state_lock`` keeps those readers off a commit or a heal half done.
STATE_GROUP = "state"


@ray.remote(concurrency_groups={STATE_GROUP: 1})
class TrainerWorker:
    """Rank ``rank`` of a world of ``world_size`` ranks (a classic DP world, or one cell). ``role``: ``actor``
    trains the policy (``PolicyTrainer``), ``critic`` the PPO value model (``ValueTrainer``); both run the same
    step protocol. ``save``, ``committed`` and ``pid`` run in their own thread (``STATE_GROUP``)."""

    def __init__(
        self, cfg: Dict[str, Any], rank: int, world_size: int, vocab_size: int, cell: Optional[int] = None,
        incarnation: int = 0, role: str = "actor", load_from: Optional[str] = None, heals: bool = False,
    ):
        """``load_from``: the checkpoint it starts from (None: the init weights, or with ``heals`` a live peer's
        state, received in its first quorum)."""
        from rlfw.ft.faults import FaultInjector

        # Megatron-core imports W&B when it is imported (optional there: for its timers' and inference logging), about
        # a second of every trainer's start. A trainer logs nothing to W&B (the driver does): this process refuses it.
        sys.modules.setdefault("wandb", None)
        self.cfg = OmegaConf.create(cfg)
        torch.set_num_threads(self.cfg.cluster.torch_threads)  # this run's, also on a Ray another run started
        self.rank, self.world_size, self.cell = rank, world_size, cell
        self.incarnation, self.role = incarnation, role
        self.load_from, self.heals = load_from, heals
        fault_cell, fault_rank, fault_world = fault_target(self.cfg, rank, world_size, cell)
        self.faults = FaultInjector(self.cfg.fault, self.cfg.run_dir, fault_cell, fault_rank, incarnation, role,
                                    fault_world)
        # The last minibatch this rank's group committed and how many optimizer steps (healed and saved with state).
        self.cursor = {"rl_step": -1, "minibatch_index": -1, "optimizer_steps": 0}
        self.state_lock = threading.Lock()  # held while the weights and the cursor change together
        self.device = torch.device("cpu")
        self.shape = model_shape(self.cfg, vocab_size)
        # This node's address under the cluster.host rule: the world's store and the torchft Manager bind it, and
        # Gloo (Megatron's group, torchft's) uses its interface.
        self.host = node_address(self.cfg.cluster)
        pin_gloo_interface(self.host)
        self.store = None
        self.trainer = None
        self.sync = None
        self.offload = None  # cluster.placement=colocated: the optimizer state and grads off the GPU between calls
        self.shared_weights = None  # rollout.weight_transport=device: the last export's packed buffer, kept for the engines

    def serve_store(self) -> Tuple[str, int]:
        """Rank 0 owns the world's store; the others connect to the address it returns (its node's: a classic
        world's ranks may sit on other nodes)."""
        self.store = serve_store(self.host)
        return self.host, self.store.port

    def setup(self, store_address: Tuple[str, int], sync_factory) -> Optional[str]:
        """Join the world, build the trainer and the sync; returns the sync's replica id (the Lighthouse's name
        for the cell, whose heartbeat the driver watches; None in a classic world)."""
        from rlfw.megatron.cpu_compat import apply_cpu_compat
        from rlfw.megatron.process_groups import join_world

        device = self.device = resolve_device(self.cfg)
        if device.type == "cpu":
            apply_cpu_compat()
        else:
            torch.cuda.set_device(device)
        store = self.store or connect_store(*store_address)
        self.store = store
        ft = self.cfg.ft
        # A cell's Megatron groups carry one forward/backward's collectives: a peer late by a collective timeout is
        # stalled. A classic world's data-parallel group also waits out its slowest rank's forward/backward: it gets
        # the phase deadlines' floor, and the driver's deadline for the phase bounds a hang.
        groups_timeout_s = (ft.collective_timeout_s if self.cfg.dp.mode == "cells"
                            else max(ft.collective_timeout_s, ft.first_call_timeout_s))
        join_world(store, self.rank, self.world_size, device, tp=self.cfg.dp.tp, pp=self.cfg.dp.pp,
                   timeout_s=ft.collective_timeout_s, groups_timeout_s=groups_timeout_s)
        if self.role == "critic":
            self._setup_critic(device)
        else:
            self._setup_policy(device)
        self.sync = sync_factory(self)
        if self.load_from is not None:
            from rlfw.checkpoint.layout import role_dir
            from rlfw.checkpoint.state import load_state

            self.cursor.update(load_state(str(role_dir(self.load_from, self.role)), self.trainer)["cursor"])
            self.sync.restore(self.cursor["optimizer_steps"])
        if self.cfg.cluster.placement == "colocated":
            from rlfw.megatron.offload import trainer_offload

            # the engine generates first: the state is on the device inside train calls and saves only
            self.offload = trainer_offload(self.trainer)
            self.offload.release()
        return self.sync.replica_id

    def _recompute(self) -> Dict[str, Any]:
        return {"recompute": self.cfg.model.recompute, "recompute_modules": list(self.cfg.model.recompute_modules)}

    def _setup_policy(self, device: torch.device) -> None:
        from rlfw.megatron.policy import PolicyTrainer

        self.trainer = PolicyTrainer(
            self.shape, self.cfg.algo, tp=self.cfg.dp.tp, temperature=self.cfg.rollout.temperature, device=device,
            init_seed=self.cfg.model.init_seed, bf16=self.cfg.model.bf16, **self._recompute(),
        )
        if self.cfg.model.hf_path:  # the checkpoint replaces the random init, in the frozen reference too
            from rlfw.model.hf_checkpoint import load_hf_weights

            modules = [m for m in (self.trainer.model.module, self.trainer.reference) if m is not None]
            load_hf_weights(self.cfg.model.hf_path, self.shape, *modules)
            self.trainer.optimizer.reload_model_params()  # fp32 master weights (bf16 runs) follow the new values

    def _setup_critic(self, device: torch.device) -> None:
        from rlfw.megatron.critic import ValueTrainer

        critic = self.cfg.algo.critic
        self.trainer = ValueTrainer(
            self.shape, self.cfg.algo, critic, tp=self.cfg.dp.tp, device=device, init_seed=self.cfg.model.init_seed,
            bf16=self.cfg.model.bf16, **self._recompute(),
        )
        if self.cfg.model.hf_path and critic.init_from_policy:
            self.trainer.load_hf_policy(self.cfg.model.hf_path)

    # --------------------------------------------------------------------------------------------- protocol
    def compute_logprobs(self, batch: RolloutBatch, indices: List[int]) -> Dict[str, List[List[float]]]:
        """The pre-update phase: the actor's log-probs, or the critic's values (``old_values``)."""
        part = batch.select(indices)
        return self.trainer.values(part) if self.role == "critic" else self.trainer.logprobs(part)

    def train(self, minibatches, call: Dict[str, Any]) -> List[Dict[str, Any]]:
        """One optimizer step per minibatch not committed yet (``rlfw.train_group.minibatches``). ``minibatches``
        is a list of whole minibatches (delayed split) or of EagerParts (eager split); ``call`` the driver's call."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.offload is None:
            return self._with_peak(train_minibatches(self.sync, self, minibatches, call, self.cfg.split))
        # colocated: the state comes back for the call and leaves after it, while the engine generates
        released = self.offload.last
        self.offload.restore()
        try:
            records = train_minibatches(self.sync, self, minibatches, call, self.cfg.split)
        finally:
            self.offload.release()
        for record in records[:1]:  # the handover's cost: the previous release and this call's restore
            record.update({"time/state_release": released.get("release_s", 0.0),
                           "time/state_restore": released.get("restore_s", 0.0),
                           "offload/released_gib": released.get("released_gib", 0.0)})
        return self._with_peak(records)

    def _with_peak(self, records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The call's peak GPU memory (allocated by this process) in its first record."""
        if self.device.type == "cuda":
            for record in records[:1]:
                record["gpu/train_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return records

    @ray.method(num_returns=2)
    def export_weights(self) -> Tuple[Any, bool]:
        """Full weights in Hugging Face names, for the rollout engines (every TP rank of the replica calls it), and
        True. Two returns so that the driver waits on the small second one alone (its error, if the export
        failed) and passes the first on as a reference, never deserialising the weights itself (gigabytes a step
        for a real model). The rollout manager receives them and keeps its own copy, for the engines it loads
        and for those it restarts after the writer's node is gone.

        With ``rollout.weight_transport=device`` (``weights_on_device``) the first return is a ``SharedWeights``
        instead: the CUDA IPC handle of one packed copy on this GPU, which this rank keeps until its next export
        (by then every engine loaded it: the manager pushes one version at a time, and a step waits for its own).
        Only rank 0 packs; the other TP ranks return None (the driver passes on rank 0's answer)."""
        from rlfw.model.hf_convert import megatron_to_hf

        self.faults.maybe_fault("weight_sync", self.cursor["rl_step"])  # the step just committed
        full = self.trainer.full_weights()
        if weights_on_device(self.cfg, self.device.type):
            from rlfw.model.device_weights import pack

            if self.rank != 0:
                return None, True
            self.shared_weights = None  # the last version's buffer goes before the next is allocated
            self.shared_weights = pack(megatron_to_hf({k: v.detach() for k, v in full.items()}, self.shape))
            return self.shared_weights.share(), True
        return megatron_to_hf({k: v.detach().cpu().clone() for k, v in full.items()}, self.shape), True

    @ray.method(concurrency_group=STATE_GROUP)
    def save(self, path: str, step: int) -> None:
        """Write this world's state into ``path`` (a collective over the world; the driver commits it). Runs even
        while a train call waits in a quorum: the weights and the cursor it writes are those of the last commit."""
        from rlfw.checkpoint.state import save_state

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        with self.state_lock, self.offload.resident() if self.offload is not None else nullcontext():
            save_state(path, self.trainer, {"step": step, "cursor": dict(self.cursor)})
        self.faults.maybe_fault("checkpoint_save", step - 1)  # written, not yet committed

    @ray.method(concurrency_group=STATE_GROUP)
    def committed(self) -> Dict[str, int]:
        """The cursor: the last minibatch this rank's group committed, and its optimizer steps."""
        with self.state_lock:
            return dict(self.cursor)

    @ray.method(concurrency_group=STATE_GROUP)
    def pid(self) -> int:
        """This rank's process id: what a fault (SIGKILL, SIGSTOP) from outside is sent to."""
        return os.getpid()

    def weights_digest(self) -> str:
        """SHA-256 over every weight's bytes: equal digests mean bitwise-equal replicas."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.trainer.named_weights().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def shutdown(self) -> None:
        if self.sync is not None:
            self.sync.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
