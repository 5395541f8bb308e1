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
    # The address every rlfw listener binds, per node: auto (loopback locally, the node's Ray address on a cluster),
    # an IP (one node), an interface name (eth0) or a subnet (10.0.0.0/24); never a wildcard (rlfw.cluster.address)
    host: str = "auto"
    # spread: a cell keeps off nodes that hold one where another node could hold it (a lost node costs one cell);
    # pack: wherever Ray puts it. A cell's own ranks always share a node (rlfw.train_group.placement)
    cell_placement: str = "spread"
    # Ray labels every trainer rank's node must carry, as `ray start --labels` writes them (role=train,zone=a) or
    # with ':' (role:train, no quoting on Hydra's command line); "" = any node (rlfw.cluster.labels)
    trainer_label_selector: str = ""
    num_cpus: Optional[float] = None  # CPUs of the local Ray instance; None = all
    cpus_per_worker: float = 0.25  # Ray CPU share of each trainer rank; fractional so ranks fit on 2 cores
    torch_threads: int = 1  # intra-op threads per worker process (oversubscription is the CPU killer)
    device: str = "auto"  # auto | cpu | cuda
    # GPUs of each trainer rank (CUDA): 1, or a share (0.5: two one-rank cells on one GPU, their torchft group on Gloo)
    gpus_per_worker: float = 1.0
    # separate: engines on GPUs of their own (rollout.gpus_per_engine each); colocated: engines on the trainers' GPUs,
    # memory handed over between generation and training (rlfw.train_group.offload; README says which to pick)
    placement: str = "separate"


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
class SGLangConfig:
    """rollout=sglang: SGLang servers launched as Ray actors (``urls`` empty) or attached (``urls`` given)."""

    urls: List[str] = field(default_factory=list)  # attach to these running servers (http://host:port); [] = launch
    router_url: Optional[str] = None  # attach: generate through this SGLang router; weights still go to every url
    # launch: the server program ({python}: rlfw's interpreter); rlfw appends --model-path, --host, --port,
    # --tp-size, --weight-version, --random-seed, --skip-tokenizer-init, then extra_args
    launch_command: List[str] = field(default_factory=lambda: ["{python}", "-m", "sglang.launch_server"])
    extra_args: List[str] = field(default_factory=list)  # launch: more server flags, e.g. [--mem-fraction-static,0.7]
    base_port: int = 30000  # launch: engine i listens on cluster.host:base_port+i
    gpus_per_engine: int = 1  # launch: Ray GPUs of each server, also its --tp-size (0: CPU builds of SGLang)
    startup_timeout_s: float = 900.0  # launch: a server not healthy by then fails, naming it, its URL, its log tail
    request_timeout_s: float = 600.0  # one /generate call
    weight_update_timeout_s: float = 600.0  # one /update_weights_from_disk call
    control_timeout_s: float = 30.0  # one health or model-info call
    max_retries: int = 3  # re-sends of a failed /generate batch, to another server when one is serving
    retry_backoff_s: float = 1.0  # wait before retry k: retry_backoff_s * 2**(k-1)
    weights_dir: Optional[str] = None  # checkpoints the servers load (they must see it); None = each engine's workdir
    # disk: HF checkpoint + /update_weights_from_disk; tensor: shared memory + /update_weights_from_tensor (the server
    # on the engine's node; slower than the disk on CPU and GPU alike, BENCHMARKS.md); distributed: not implemented
    weight_sync: str = "disk"
    # A push during a generate call: true aborts the call's requests, loads and sends them on from their tokens under
    # the new weights (partial rollouts); false loads once the call ends, so a call's tokens all come from one
    # version (as through a router), and none is sampled twice
    partial_rollouts: bool = True


@dataclass
class ToolsConfig:
    """The worker processes that run an environment's tool calls (rlfw/rollout/envs/tool_pool.py); an environment
    with tools takes this node as its ``tool_pool`` (conf/task/calc.yaml)."""

    workers: int = 2  # processes, hence tool calls at once
    timeout_s: float = 10.0  # one call; past it the worker is killed and replaced, the call an error observation
    memory_mb: int = 1024  # address-space cap of each worker (and the programs it runs); 0 = none
    max_output_chars: int = 2000  # a longer output is cut here, and the observation says so


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
    # Ray labels the engines' nodes must carry (role:rollout, as cluster.trainer_label_selector); "" = any node
    engine_label_selector: str = ""
    max_inflight_requests: int = 0  # samples one engine works on at a time (one call); 0 = the step's share at once
    max_engine_restarts: int = 3  # dead engines replaced over the run (requests retried); past it a dead one retires
    engine_call_timeout_s: float = 1800.0  # one engine call (a chunk of generation, a weight load); then it is hung
    step_timeout_s: float = 7200.0  # the driver's wait for one step's rollout or weight push; then the run stops
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more prompts instead
    max_oversample_rounds: int = 3  # dynamic_sampling: extra sampling rounds per step; then train on what was kept
    kv_cache_gb: float = 0.5  # vllm: CPU memory of each engine's KV cache
    # local, CUDA: sequences decoded together (continuous batching: a finished one's slot takes the next request);
    # 0 = every request of a call at once. Sizes the key-value cache (rlfw.config.devices checks it fits)
    max_batch: int = 0
    cuda_graphs: bool = True  # local, CUDA: replay the decode step as CUDA graphs (off: eager, for comparison)
    gpus_per_engine: float = 1.0  # local, CUDA, cluster.placement=separate: Ray GPUs of each engine
    # How the writer's weights reach local engines. host: a CPU copy through Ray (any node; an engine restarted
    # after its writer died loads it). device: one CUDA IPC handle to a packed copy on the writer's GPU, copied
    # device to device (engines on the writer's node; GPUs that reach each other). auto: device for the local
    # engine on CUDA in a local Ray (one node), else host. rlfw.model.device_weights
    weight_transport: str = "auto"
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # rollout=sglang only
    tools: ToolsConfig = field(default_factory=ToolsConfig)  # environments with tools (task=calc, gsm8k_tools)


@dataclass
class ModelConfig:
    """Architecture keys may be None only with ``hf_path``: they are then read from the checkpoint's config.json."""

    name: str = MISSING
    hf_path: str | None = None  # local HF checkpoint dir (Llama/Qwen2/Qwen3): architecture, weights; no download
    num_layers: int | None = 2
    hidden_size: int | None = 128
    num_attention_heads: int | None = 4
    num_query_groups: int | None = 2
    ffn_hidden_size: int | None = 512
    head_dim: int | None = None  # width of one attention head (Megatron kv_channels); None = hidden / heads
    vocab_size: int | None = None  # embedding rows; None = the task tokenizer's size rounded up to 8 x dp.tp
    max_seq_len: int = 64  # training context (prompt + response); not read from the checkpoint
    rope_theta: float | None = 10000.0
    norm_epsilon: float | None = 1e-5
    qkv_bias: bool | None = False  # biases on the q/k/v projections (Qwen2)
    qk_layernorm: bool | None = False  # RMSNorm on every query and key head before RoPE (Qwen3)
    tie_word_embeddings: bool | None = False  # output layer shares the input embedding
    rope_scaling_factor: float | None = None  # Llama 3.x RoPE scaling factor (HF rope_type llama3); None = plain RoPE
    init_seed: int = 1234  # random initialisation (without hf_path)
    bf16: bool = True  # CUDA only: bf16 weights and activations, fp32 grads and master weights; CPU runs fp32
    # Activation recompute (memory for time; the math is unchanged): none | selective (recompute_modules, a subset
    # of mlp, core_attn) | full (every layer's forward again in the backward). BENCHMARKS.md has the cost on a GPU.
    recompute: str = "none"
    recompute_modules: List[str] = field(default_factory=lambda: ["mlp"])


@dataclass
class CriticConfig:
    """algo=ppo: the value model (rlfw/megatron/critic.py), a second train group beside the policy's."""

    lr: float = 1e-3  # the critic's Adam learning rate (betas, weight decay, grad clip: the policy's)
    value_clip: float = 0.2  # clip V to V_old +- value_clip in the value loss; 0 = off (plain squared error)
    init_from_policy: bool = True  # trunk starts from the policy's initial weights (model.hf_path too); else random
    # Replicas of the critic group: None = the policy's; any other value must equal it (replica i pairs with i)
    num_replicas: Optional[int] = None


@dataclass
class AlgoConfig:
    name: str = MISSING  # advantage estimator: grpo | rloo | reinforce_pp | ppo (rlfw.algo.advantages.ESTIMATORS)
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables
    normalize_adv_std: Optional[bool] = None  # grpo only: divide by the group std (false = Dr. GRPO); grpo.yaml: true
    baseline: Optional[str] = None  # reinforce_pp only: none (REINFORCE++) | group_mean (REINFORCE++-baseline)
    gamma: Optional[float] = None  # ppo only: GAE discount per response token, in [0, 1]; ppo.yaml: 1.0
    gae_lambda: Optional[float] = None  # ppo only: GAE lambda, in [0, 1]; ppo.yaml: 0.95
    critic: CriticConfig = field(default_factory=CriticConfig)  # ppo only: the value model
    # grpo, rloo: turn-level credit, in [0, 1]: a turn's tokens earn its reward plus the later turns' discounted by
    # this per turn (rlfw.algo.advantages); None = every token earns the episode's reward (task=calc: 0.0)
    turn_discount: Optional[float] = None
    clip_eps_low: float = 0.2  # ratio clipped to [1 - clip_eps_low, 1 + clip_eps_high]
    clip_eps_high: float = 0.2
    dual_clip_c: float = 0.0  # > 1: cap the loss of A < 0 tokens at -A * c (dual clip, e.g. 3); 0 = off
    kl_loss_coef: float = 0.0  # > 0: KL(pi || ref) loss term per token (builds a frozen reference model)
    kl_reward_coef: float = 0.0  # > 0: -coef * KL per token in the reward, as rewards-to-go (builds the reference)
    kl_estimator: str = "k3"  # k1 | k2 | k3, for both KL terms (k1 is the usual choice in the reward)
    entropy_coef: float = 0.0  # > 0: entropy bonus (full-vocabulary entropy of the policy)
    tis_cap: float = 0.0  # >= 1: truncated importance sampling, weight min(exp(old - rollout logprob), cap); 0 = off
    loss_agg: str = "token_mean"  # token_mean | sample_mean (sum per sample) | seq_mean_token_mean
    on_nonfinite: str = "stop"  # NaN/inf advantage, ratio, loss or gradient: stop (raise) | skip (the optimizer step)
    global_batch_size: int = 0  # samples per optimizer step; 0 = the whole rollout batch (one step per rollout)
    # auto: with one optimizer step per rollout and no KL term, the old (proximal) log-probs are the training
    # forward's own, detached (the same values, one forward pass fewer); recompute: a separate pass every step
    old_logprobs: str = "auto"
    max_tokens_per_microbatch: int = 512  # token budget of one packed micro-batch; GPU runs: 16384 (BENCHMARKS.md)
    head_chunk_tokens: int = 4096  # tokens per pass of the output head (rlfw.megatron.head; BENCHMARKS.md)


@dataclass
class FTConfig:
    lighthouse_address: Optional[str] = None  # join an existing Lighthouse; None = the driver starts one
    lighthouse_port: int = 0  # 0 = any free port on cluster.host
    min_cells: int = 1
    # The rules between these timeouts are checked by validate.py and listed in the README ("Timeouts").
    # Lighthouse: a Manager silent this long leaves the quorum (a dead cell). It bounds a death's cost: a quorum
    # needs more than half of the replicas the Lighthouse hears, so with 2 cells the survivor's next quorum waits
    # for the dead one's heartbeat to expire. Managers beat every 100 ms from native code (GIL-free): 10 beats.
    heartbeat_timeout_s: float = 1.0
    join_timeout_s: float = 0.5  # Lighthouse: once a quorum could form, how long it waits for more members
    stall_timeout_s: float = 15.0  # the driver fails a cell whose Manager the Lighthouse has not heard this long
    # A call still running past max(min_phase_timeout_s, phase_timeout_factor x the slowest earlier call of its
    # phase) fails the cell (slow but beating), or ends a classic world; the first call of a phase (warm-up) gets
    # first_call_timeout_s (rlfw.train_group.deadlines).
    phase_timeout_factor: float = 5.0
    min_phase_timeout_s: float = 60.0
    first_call_timeout_s: float = 1800.0
    quorum_timeout_s: float = 150.0  # a Manager's wait for its quorum (beyond the call's deadline, for its peers)
    collective_timeout_s: float = 30.0  # one all-reduce, and the cell's own process group
    # Cells that meet over Gloo (CPU cells, cells sharing a GPU) sum their gradients through: shm (shared memory,
    # when every cell of the quorum is on this host and /dev/shm holds the gradients; else Gloo, saying why in the
    # log: rlfw/ft/host_shared.py) | gloo (Gloo's TCP ring always). Cells with a GPU each use NCCL either way.
    host_transport: str = "shm"
    heal_min_bandwidth_mb_s: float = 50.0  # a heal may take collective_timeout_s + state bytes at this rate
    writer_timeout_s: float = 600.0  # one weight export or checkpoint save by the writer; then the next cell writes
    replace_failed: bool = True
    max_replacements: int = 16  # replacements started over the run (-1: no limit); past it the survivors go on
    # When every cell holding the trained state dies (no live peer to heal from), the job restores its newest
    # checkpoint by itself, up to this many times (0: it stops instead, and resume=auto restarts it).
    max_state_restores: int = 3
    replacement_backoff_s: float = 1.0  # a cell id failing again before it committed waits this, doubled per failure
    replacement_deadline_s: float = 120.0  # how long the driver waits for a replacement when below min_cells
    # Before a step, wait up to this long for replacements still setting up (0 = never wait: a replacement
    # joins whenever it is ready). Demos and tests use it to make the heal happen at a predictable step.
    await_replacement_s: float = 0.0
    # Compare every replica's weights bitwise (SHA-256 of every rank's shard) every N steps; 0 = never. The default
    # costs well under 1 % of the run (time/verify_weights in the metrics; BENCHMARKS.md).
    verify_weights_every: int = 10


@dataclass
class FaultConfig:
    """Real process deaths for tests and demos (rlfw/ft/faults.py)."""

    kind: str = "none"  # none | kill_once | random
    role: str = "actor"  # whose workers die: actor (the policy's) | critic (algo=ppo's value model)
    cell: int = 0  # kill_once: which cell (-1 = whichever gets there first)
    step: int = 1  # kill_once: the first RL step at which the kill may fire
    phase: str = "before_forward"  # a phase of rlfw.ft.faults.PHASES (random: or "any")
    signal: str = "kill"  # kill (SIGKILL: the cell dies) | stop (SIGSTOP every rank from outside, then SIGCONT)
    duration_s: float = 0.0  # signal=stop: how long the cell stays stopped
    extra_kills: List[Dict[str, Any]] = field(default_factory=list)  # more {cell, step, phase, incarnation, signal,
    # duration_s}
    probability: float = 0.0  # random: chance per cell, step and phase
    seed: int = 0


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0 = only when the run ends)
    save_final: bool = True
    dir: Optional[str] = None  # default: <run_dir>/checkpoints
    keep_last: int = 0  # delete all but the newest N committed checkpoints; 0 keeps every one


@dataclass
class LoopConfig:
    mode: str = MISSING  # sync | async (rollouts of the next steps generated while the current one trains)
    # async: policy versions a sample's oldest token may lag behind the weights that train on it (0 = sync, exactly)
    max_staleness: int = 0


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
    num_steps: int = 100  # the default job's task is learned by then (BENCHMARKS.md, the default run)
    run_dir: Optional[str] = None  # default: Hydra's output dir
    # none | auto (the newest checkpoint that verifies under checkpoint.dir, or a fresh start) | a checkpoint dir
    resume: str = "none"
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
    loop: LoopConfig = field(default_factory=LoopConfig)


def register_configs() -> None:
    """Only the root schema is stored: it types every group's node, so a group's YAML is checked when it merges.
    (A schema stored inside a group would be offered as an option of that group, e.g. ``split=split_schema``.)"""
    ConfigStore.instance().store(name="rlfw_schema", node=RLConfig)
