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
A trainer rank's forward/backward adds its activations (``activation_bytes``: a micro-batch of
``algo.max_tokens_per_microbatch`` tokens, after ``model.recompute``, and one chunk of the output head's fp32
logits), and every process on a GPU its CUDA context and the allocator's slack (``PROCESS_BYTES``). Held against the
GPU runs of BENCHMARKS.md (Qwen2-0.5B and 1.5B shapes, micro-batches of 4096 and 16384 tokens, no, MLP and full
recompute) the estimate of a rank's peak is within 5 % of the measured one (``tests/config/test_gpu_memory.py``).
What is not counted: a colocated SGLang server's use beyond its ``--mem-fraction-static`` share (its CUDA graphs and
a forward's activations: about 10 GiB at 0.25 of an H100 beside two 0.5B cells, BENCHMARKS.md), so the check
refuses placements that cannot fit; it does not promise that one that passes will.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlfw.errors import ConfigError
from rlfw.model.shape import ModelShape

GIB = 1 << 30
TRAIN_BYTES_PER_PARAM = 18  # bf16 weight 2 + fp32 master 4 + fp32 main grad 4 + Adam moments 8
RESIDENT_TRAIN_BYTES_PER_PARAM = 6  # colocated, while the engine generates: bf16 weight + fp32 master stay
# A GPU process's CUDA context, kernels and the caching allocator's slack beyond the tensors it holds (the GPU rows
# of BENCHMARKS.md: the card's peak less the processes' own peaks, 1.2-1.7 GiB a process)
PROCESS_BYTES = 3 * GIB // 2
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


def packed_bytes(shape: ModelShape) -> int:
    """The writer's packed bf16 copy for the engines (``weights_on_device``): the engine's state dict, which holds
    a tied output layer apart from the embedding."""
    return 2 * (num_params(shape) + (shape.vocab_size * shape.hidden_size if shape.tie_word_embeddings else 0))


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    return 2 * shape.num_layers * shape.num_query_groups * shape.head_dim * dtype_bytes


def activation_bytes(cfg, shape: ModelShape) -> int:
    """The most bytes one trainer rank's forward/backward holds beyond its weights, gradients and optimizer state.

    Per token of a micro-batch each layer keeps ``8 h + 3 ffn`` activations for its backward (the norms' inputs and
    outputs, q/k/v, the attention's output, the residuals; the MLP's fc1 output, gate and product): with
    ``model.recompute=selective`` over ``mlp`` the MLP's three ffn-wide tensors go (one layer's are rebuilt at a
    time), with ``full`` only each layer's input stays (and one layer's activations while it is recomputed). The
    output head adds one chunk of fp32 logits (``algo.head_chunk_tokens`` x the vocabulary's tensor-parallel share).
    Tensor parallelism splits the activations across its ranks (an approximation: the norms' are replicated)."""
    tokens = cfg.algo.max_tokens_per_microbatch
    h, ffn, layers = shape.hidden_size, shape.ffn_hidden_size, shape.num_layers
    dtype_bytes = 2 if cfg.model.bf16 and cfg.cluster.device != "cpu" else 4
    per_layer = 8 * h + 3 * ffn
    if cfg.model.recompute == "full":
        per_token = layers * h + per_layer
    elif cfg.model.recompute == "selective" and "mlp" in cfg.model.recompute_modules:
        per_token = layers * (per_layer - 3 * ffn) + 3 * ffn
    else:
        per_token = layers * per_layer
    head = min(tokens, cfg.algo.head_chunk_tokens) * -(-shape.vocab_size // cfg.dp.tp) * 4
    return tokens * per_token * dtype_bytes // cfg.dp.tp + head


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
    """The bytes one GPU must hold in each phase of a step. Of ``train``: ``activations``, the trainer ranks'
    (what a smaller micro-batch or recompute lowers), and ``server``, what a colocated SGLang server keeps."""

    train: int
    generate: int
    activations: int = 0
    server: int = 0

    @property
    def peak(self) -> int:
        return max(self.train, self.generate)


def ranks_per_gpu(cfg) -> int:
    return max(1, round(1 / cfg.cluster.gpus_per_worker))


def trainer_params(cfg, shape: ModelShape) -> int:
    """Parameters the trainer ranks sharing one GPU hold (each its tensor-parallel share)."""
    return ranks_per_gpu(cfg) * (num_params(shape) // cfg.dp.tp)


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
    engine = engine_weights + kv_bytes_per_token(shape) * shape.max_seq_len * max_batch + PROCESS_BYTES
    trainers, ranks = trainer_params(cfg, shape), ranks_per_gpu(cfg)
    packed = packed_bytes(shape) if weights_on_device(cfg, "cuda") else 0  # the writer's copy for the engines
    activations = ranks * activation_bytes(cfg, shape)
    training = trainers * TRAIN_BYTES_PER_PARAM + activations + ranks * PROCESS_BYTES + packed
    resident = trainers * RESIDENT_TRAIN_BYTES_PER_PARAM + ranks * PROCESS_BYTES + packed
    share = sglang_share(cfg)
    if share is not None:
        server = int(share * (gpu_bytes - resident))  # SGLang's weights and cache: its share of what is free
        if server < engine_weights:
            raise ConfigError(
                f"rollout.sglang.extra_args: --mem-fraction-static={share:g} gives the SGLang server {server / GIB:.1f}"
                f" GiB of the {(gpu_bytes - resident) / GIB:.1f} GiB its GPU has free beside the trainers' resident "
                f"{resident / GIB:.1f} GiB: less than its {engine_weights / GIB:.1f} GiB of bf16 weights; raise "
                "--mem-fraction-static"
            )
        server += PROCESS_BYTES
        return GpuBudget(train=training + server, generate=resident + server, activations=activations,
                         server=server)
    if cfg.cluster.placement == "colocated":  # the engine's cache is freed while the trainers train
        return GpuBudget(train=training + engine_weights + PROCESS_BYTES, generate=resident + engine,
                         activations=activations)
    if cfg.cluster.gpus_per_worker < 1 or cfg.rollout.gpus_per_engine < 1:  # Ray may put both on one GPU
        return GpuBudget(train=training + engine, generate=training + engine, activations=activations)
    return GpuBudget(train=training, generate=engine, activations=activations)


def check_gpu_memory(cfg, shape: ModelShape, gpu_bytes: int, samples_per_engine: int) -> GpuBudget:
    """Raise ConfigError when a phase of the step cannot fit a GPU of ``gpu_bytes``, naming sizes and keys."""
    budget = gpu_budget(cfg, shape, samples_per_engine, gpu_bytes)
    params = num_params(shape)
    ranks = ranks_per_gpu(cfg)
    activations = (f"{budget.activations / GIB:.1f} GiB of it the activations of {ranks} rank(s) at "
                   f"algo.max_tokens_per_microbatch={cfg.algo.max_tokens_per_microbatch}, model.recompute="
                   f"{cfg.model.recompute}")
    lower_activations = "lower algo.max_tokens_per_microbatch, set model.recompute=selective or full"
    share = sglang_share(cfg)
    if share is not None and budget.train > gpu_bytes:
        raise ConfigError(
            f"a GPU of {gpu_bytes / GIB:.1f} GiB cannot hold this run's training phase beside its SGLang server, which "
            f"keeps {budget.server / GIB:.1f} GiB (--mem-fraction-static={share:g} of what was free at its start, "
            f"and its process) while the trainers need {(budget.train - budget.server) / GIB:.1f} GiB "
            f"({TRAIN_BYTES_PER_PARAM} bytes a parameter per rank, {ranks} rank(s) a GPU; {activations}); lower "
            f"--mem-fraction-static in rollout.sglang.extra_args, {lower_activations}, raise dp.tp, or use fewer "
            "ranks a GPU (cluster.gpus_per_worker)"
        )
    if budget.peak > gpu_bytes:
        phase = "training" if budget.train >= budget.generate else "generation"
        raise ConfigError(
            f"a GPU of {gpu_bytes / GIB:.1f} GiB cannot hold this run's {phase} phase: it needs "
            f"{budget.peak / GIB:.1f} GiB (model of {params / 1e9:.2f} B parameters; training "
            f"{budget.train / GIB:.1f} GiB: {TRAIN_BYTES_PER_PARAM} bytes a parameter per rank, {ranks} rank(s) a GPU "
            f"at cluster.gpus_per_worker={cfg.cluster.gpus_per_worker:g}, dp.tp={cfg.dp.tp}, {activations}; "
            f"generation {budget.generate / GIB:.1f} GiB: bf16 weights and a key-value cache of rollout.max_batch="
            f"{cfg.rollout.max_batch or samples_per_engine} sequences x model.max_seq_len={shape.max_seq_len} "
            f"tokens) under cluster.placement={cfg.cluster.placement}; {lower_activations}, raise dp.tp, give each "
            "rank a whole GPU (cluster.gpus_per_worker=1), lower rollout.max_batch or model.max_seq_len"
            + (", or use cluster.placement=colocated" if cfg.cluster.placement == "separate" else "")
        )
    return budget
