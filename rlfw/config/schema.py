"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML files under ``conf/`` are merged onto these dataclasses, so a misspelt key or a wrong type fails during
composition, naming the key, before Ray or Megatron starts. Cross-field rules live in ``validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # join an existing Ray cluster ("auto" or host:port); None starts a local one
    host: str = "127.0.0.1"  # interface every rlfw listener binds (Ray, stores, torchft); loopback unless set
    num_cpus: Optional[float] = None  # CPUs of the local Ray instance; None = all
    cpus_per_worker: float = 0.25  # Ray CPU share of each trainer rank; fractional so ranks fit on 2 cores
    torch_threads: int = 1  # intra-op threads per worker process (oversubscription is the CPU killer)
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class DPConfig:
    mode: str = MISSING  # classic | cells
    size: int = 2  # classic: data-parallel ranks of the one Megatron world
    num_cells: int = 2  # cells: independent Megatron worlds, one data-parallel replica each
    tp: int = 1  # tensor-parallel ranks per replica
    pp: int = 1  # pipeline stages per replica (only 1 is supported)

    @property
    def replicas(self) -> int:
        return self.size if self.mode == "classic" else self.num_cells


@dataclass
class SplitConfig:
    name: str = MISSING  # eager | delayed | balanced, or custom when the knobs are mixed
    when: str = "train"  # rollout: one object ref per replica at rollout time; train: split after the quorum
    how: str = "strided"  # strided | balanced (Karmarkar-Karp over token workload)
    attention_weight: float = 1.0 / (6 * 4096)  # quadratic attention term of the workload cost (see partition)


@dataclass
class RolloutConfig:
    backend: str = MISSING  # local | vllm | sglang
    num_prompts: int = 32  # prompts per RL step
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 0  # 0 = the task's own limit
    num_engines: int = 1
    cpus_per_engine: float = 0.5


@dataclass
class ModelConfig:
    name: str = MISSING
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 512
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-5
    init_seed: int = 1234
    bf16: bool = True  # CUDA only: bf16 weights and activations, fp32 grads and master weights; CPU runs fp32


@dataclass
class AlgoConfig:
    name: str = MISSING  # grpo
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0  # >0 builds a frozen reference model and adds a k3 KL loss
    loss_agg: str = "token_mean"  # token_mean | sample_mean
    normalize_adv_std: bool = True  # GRPO divides by the group std; False = Dr. GRPO
    global_batch_size: int = 0  # samples per optimizer step; 0 = the whole rollout batch (one step per rollout)
    max_tokens_per_microbatch: int = 512  # token budget of one packed micro-batch


@dataclass
class FTConfig:
    lighthouse_address: Optional[str] = None  # join an existing Lighthouse; None = the driver starts one
    lighthouse_port: int = 0  # 0 = any free port on cluster.host
    min_cells: int = 1
    heartbeat_timeout_s: float = 2.0
    join_timeout_s: float = 0.5
    quorum_timeout_s: float = 60.0
    collective_timeout_s: float = 30.0
    replace_failed: bool = True
    replacement_deadline_s: float = 120.0
    # Before a step, wait up to this long for replacements still setting up (0 = never wait: a replacement
    # joins whenever it is ready). Demos and tests use it to make the heal happen at a predictable step.
    await_replacement_s: float = 0.0
    verify_weights_every: int = 0  # compare every replica's weights bitwise (SHA-256) every N steps; 0 = never


@dataclass
class FaultConfig:
    """Real process deaths for tests and demos (rlfw/ft/faults.py)."""

    kind: str = "none"  # none | kill_once | random
    cell: int = 0  # kill_once: which cell (-1 = whichever gets there first)
    step: int = 1  # kill_once: the first RL step at which the kill may fire
    phase: str = "before_forward"  # a phase of rlfw.ft.faults.PHASES (random: or "any")
    extra_kills: List[Dict[str, Any]] = field(default_factory=list)  # more {cell, step, phase, incarnation}
    probability: float = 0.0  # random: chance per cell, step and phase
    seed: int = 0


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0 = only when the run ends)
    save_final: bool = True
    dir: Optional[str] = None  # default: <run_dir>/checkpoints


@dataclass
class LoggerConfig:
    backends: List[str] = field(default_factory=lambda: ["jsonl", "console", "wandb"])
    wandb_project: str = "rlfw"
    wandb_mode: str = "auto"  # auto (online with an API key, else offline) | online | offline | disabled
    wandb_group: Optional[str] = None


@dataclass
class RLConfig:
    defaults: List[Any] = field(default_factory=lambda: ["_self_"])
    seed: int = 1
    num_steps: int = 200
    run_dir: Optional[str] = None  # default: Hydra's output dir
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: Dict[str, Any] = field(default_factory=dict)  # a `_target_` node: any task class, user tasks too
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="rlfw_schema", node=RLConfig)
    for group, schema in [
        ("dp", DPConfig),
        ("split", SplitConfig),
        ("rollout", RolloutConfig),
        ("model", ModelConfig),
        ("algo", AlgoConfig),
        ("logger", LoggerConfig),
        ("fault", FaultConfig),
    ]:
        cs.store(group=group, name=f"{group}_schema", node=schema)
