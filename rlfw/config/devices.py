"""Which GPUs a run has, and whether its placement fits them: checked before the first step, never found out by a
wait that times out or an out-of-memory crash mid-run.

A local run counts the GPUs torch sees before Ray starts; a run on a cluster, whose driver node may have none,
counts the GPUs Ray reports once it has joined. ``cluster.device=cuda`` with none is an error naming the key and
what was seen; ``auto`` then means CPU.

The memory check is arithmetic over the model's shape (``state_bytes``): a trainer rank holds its bf16 weights,
fp32 master weights, fp32 gradient buffer and Adam's two moments (18 bytes a parameter, over its tensor-parallel
share); an engine holds bf16 weights and a key-value cache for ``rollout.max_batch`` sequences of
``model.max_seq_len`` tokens. With ``cluster.placement=colocated`` the trainer's optimizer state and gradients
leave the GPU while the engine generates and the engine's cache is freed while the trainer trains
(``rlfw.train_group.offload``, the engine's own cache), so the larger phase is what must fit; separate placement
puts engines on GPUs of their own. A colocated SGLang server keeps its memory through training: at its start it
takes its ``--mem-fraction-static`` share of the memory then free (beside the trainers' resident state) for its
weights and cache, so that share must hold its weights, and the rest of the GPU the trainers' training phase.
With the weights handed over in GPU memory (``weights_on_device``) the writer's GPU also holds a packed bf16 copy.
Activations are not counted: the check refuses placements that cannot fit, it does not promise that one that passes
will.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlfw.errors import ConfigError
from rlfw.model.shape import ModelShape

GIB = 1 << 30
TRAIN_BYTES_PER_PARAM = 18  # bf16 weight 2 + fp32 master 4 + fp32 main grad 4 + Adam moments 8
RESIDENT_TRAIN_BYTES_PER_PARAM = 6  # colocated, while the engine generates: bf16 weight + fp32 master stay
FRACTION_FLAG = "--mem-fraction-static"  # SGLang's share of the GPU memory free at its start


def num_params(shape: ModelShape) -> int:
    """Parameters of the policy (embedding, layers, final norm, output layer unless tied)."""
    h, kv = shape.hidden_size, shape.num_query_groups * shape.head_dim
    q = shape.num_attention_heads * shape.head_dim
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if shape.qkv_bias else 0)
    attention += 2 * shape.head_dim if shape.qk_layernorm else 0
    layer = attention + 3 * h * shape.ffn_hidden_size + 2 * h
    embedding = shape.vocab_size * h
    return embedding * (1 if shape.tie_word_embeddings else 2) + shape.num_layers * layer + h


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    return 2 * shape.num_layers * shape.num_query_groups * shape.head_dim * dtype_bytes


def local_gpus(cfg) -> int | None:
    """GPUs of a local run (before Ray starts): the count torch sees, None when the run is on CPU. Raises
    ConfigError for ``cluster.device=cuda`` without one."""
    if cfg.cluster.device == "cpu":
        return None
    import torch

    count = torch.cuda.device_count()
    if count == 0 and cfg.cluster.device == "cuda":
        raise ConfigError(
            "cluster.device=cuda but this machine has no GPU that torch can use (torch.cuda.device_count()=0, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}, torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use cluster.device=cpu (or auto)"
        )
    return count or None


def cluster_gpus(cfg, resources: dict) -> int | None:
    """GPUs of a run on a cluster, from Ray's ``cluster_resources()``; None when the run is on CPU. Raises
    ConfigError for ``cluster.device=cuda`` on a cluster that reports none."""
    count = int(resources.get("GPU", 0))
    if cfg.cluster.device == "cuda" and count == 0:
        raise ConfigError(
            f"cluster.device=cuda but the Ray cluster at cluster.address={cfg.cluster.address} reports no GPU "
            f"(its resources: CPU {resources.get('CPU', 0):g}, GPU 0, {len(resources)} kinds); start the GPU "
            "nodes with `ray start` on each, or use cluster.device=cpu"
        )
    if cfg.cluster.device == "cpu":
        return None
    return count or None


def samples_per_engine(cfg) -> int:
    """The most samples one engine call decodes: its share of a step, or ``rollout.max_inflight_requests``."""
    share = -(-cfg.rollout.num_prompts * cfg.rollout.n_samples_per_prompt // cfg.rollout.num_engines)
    return min(share, cfg.rollout.max_inflight_requests or share)


@dataclass
class GpuBudget:
    """The bytes one GPU must hold in each phase of a step."""

    train: int
    generate: int

    @property
    def peak(self) -> int:
        return max(self.train, self.generate)


def trainer_params(cfg, shape: ModelShape) -> int:
    """Parameters the trainer ranks sharing one GPU hold (each its tensor-parallel share)."""
    return max(1, round(1 / cfg.cluster.gpus_per_worker)) * (num_params(shape) // cfg.dp.tp)


def sglang_share(cfg) -> float | None:
    """The share of its GPU's free memory a launched SGLang server takes (``--mem-fraction-static``) when it shares
    the GPU with the trainers (cluster.placement=colocated); None otherwise. ConfigError when the flag is missing or
    outside (0, 1)."""
    sglang = cfg.rollout.sglang
    if cfg.rollout.backend != "sglang" or cfg.cluster.placement != "colocated" or sglang.urls \
            or not sglang.gpus_per_engine:
        return None
    args, value = list(sglang.extra_args), None
    for i, arg in enumerate(args):  # --flag value or --flag=value; the last one counts, as in SGLang's argparse
        if arg == FRACTION_FLAG:
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith(FRACTION_FLAG + "="):
            value = arg.partition("=")[2]
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = None
    if share is None or not 0 < share < 1:
        raise ConfigError(
            f"rollout.sglang.extra_args gives {FRACTION_FLAG} {value!r}: with cluster.placement=colocated the SGLang "
            "server shares the GPU with the trainers and keeps its memory while they train, so bound it: add "
            f"{FRACTION_FLAG},F to rollout.sglang.extra_args, F in (0, 1) the share of the GPU's free memory it "
            "takes at its start (e.g. 0.5)"
        )
    return share


def weights_on_device(cfg, device_type: str) -> bool:
    """``rollout.weight_transport`` for this run: whether the writer shares its weights in GPU memory (a CUDA IPC
    handle the engines open) instead of sending a host copy. ``auto``: on CUDA, to the local engine, in a local Ray
    (every engine on this node)."""
    transport = cfg.rollout.weight_transport
    if transport == "auto":
        return device_type == "cuda" and cfg.rollout.backend == "local" and cfg.cluster.address is None
    return transport == "device"


def gpu_budget(cfg, shape: ModelShape, samples_per_engine: int, gpu_bytes: int) -> GpuBudget:
    """The most bytes any one GPU of ``gpu_bytes`` holds in each phase under ``cluster.placement`` (see the module
    docstring)."""
    engine_weights = 2 * num_params(shape)
    max_batch = cfg.rollout.max_batch or samples_per_engine
    kv_cache = kv_bytes_per_token(shape) * shape.max_seq_len * max_batch
    trainers = trainer_params(cfg, shape)
    packed = engine_weights if weights_on_device(cfg, "cuda") else 0  # the writer's copy for the engines
    share = sglang_share(cfg)
    if share is not None:
        resident = trainers * RESIDENT_TRAIN_BYTES_PER_PARAM
        server = int(share * (gpu_bytes - resident))  # SGLang's weights and cache: its share of what is free
        if server < engine_weights:
            raise ConfigError(
                f"rollout.sglang.extra_args: --mem-fraction-static={share:g} gives the SGLang server {server / GIB:.1f}"
                f" GiB of the {(gpu_bytes - resident) / GIB:.1f} GiB its GPU has free beside the trainers' resident "
                f"{resident / GIB:.1f} GiB: less than its {engine_weights / GIB:.1f} GiB of bf16 weights; raise "
                "--mem-fraction-static"
            )
        return GpuBudget(train=trainers * TRAIN_BYTES_PER_PARAM + server, generate=resident + server)
    if cfg.cluster.placement == "colocated":
        return GpuBudget(train=trainers * TRAIN_BYTES_PER_PARAM + engine_weights + packed,
                         generate=trainers * RESIDENT_TRAIN_BYTES_PER_PARAM + engine_weights + kv_cache + packed)
    if cfg.cluster.gpus_per_worker < 1 or cfg.rollout.gpus_per_engine < 1:  # Ray may put both on one GPU
        both = trainers * TRAIN_BYTES_PER_PARAM + engine_weights + kv_cache + packed
        return GpuBudget(train=both, generate=both)
    return GpuBudget(train=trainers * TRAIN_BYTES_PER_PARAM + packed, generate=engine_weights + kv_cache)


def check_gpu_memory(cfg, shape: ModelShape, gpu_bytes: int, samples_per_engine: int) -> GpuBudget:
    """Raise ConfigError when a phase of the step cannot fit a GPU of ``gpu_bytes``, naming sizes and keys."""
    budget = gpu_budget(cfg, shape, samples_per_engine, gpu_bytes)
    params = num_params(shape)
    share = sglang_share(cfg)
    if share is not None and budget.train > gpu_bytes:
        training = trainer_params(cfg, shape) * TRAIN_BYTES_PER_PARAM
        raise ConfigError(
            f"a GPU of {gpu_bytes / GIB:.1f} GiB cannot hold this run's training phase beside its SGLang server, which "
            f"keeps {(budget.train - training) / GIB:.1f} GiB (--mem-fraction-static={share:g} of what was free "
            f"at its start) while the trainers need {training / GIB:.1f} GiB ({TRAIN_BYTES_PER_PARAM} "
            f"bytes a parameter per rank, {max(1, round(1 / cfg.cluster.gpus_per_worker))} rank(s) a GPU) before "
            "activations; lower --mem-fraction-static in rollout.sglang.extra_args, raise dp.tp, or use fewer ranks "
            "a GPU (cluster.gpus_per_worker)"
        )
    if budget.peak > gpu_bytes:
        phase = "training" if budget.train >= budget.generate else "generation"
        raise ConfigError(
            f"a GPU of {gpu_bytes / GIB:.1f} GiB cannot hold this run's {phase} phase: it needs "
            f"{budget.peak / GIB:.1f} GiB before activations (model of {params / 1e9:.2f} B parameters; training "
            f"{budget.train / GIB:.1f} GiB: {TRAIN_BYTES_PER_PARAM} bytes a parameter per rank, "
            f"{max(1, round(1 / cfg.cluster.gpus_per_worker))} rank(s) a GPU at cluster.gpus_per_worker="
            f"{cfg.cluster.gpus_per_worker:g}, dp.tp={cfg.dp.tp}; generation {budget.generate / GIB:.1f} GiB: "
            f"bf16 weights and a key-value cache of rollout.max_batch={cfg.rollout.max_batch or samples_per_engine} "
            f"sequences x model.max_seq_len={shape.max_seq_len} tokens) under cluster.placement="
            f"{cfg.cluster.placement}; raise dp.tp, give each rank a whole GPU (cluster.gpus_per_worker=1), lower "
            "rollout.max_batch or model.max_seq_len"
            + (", or use cluster.placement=colocated" if cfg.cluster.placement == "separate" else "")
        )
    return budget
