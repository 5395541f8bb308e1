"""Cross-field checks that a typed schema cannot express; run before Ray starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig

from rlfw.algo.advantages import ESTIMATOR_OPTIONS, ESTIMATORS, TURN_CREDIT_ESTIMATORS
from rlfw.algo.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS
from rlfw.cluster.address import AddressError, check_rule
from rlfw.cluster.labels import parse_labels
from rlfw.config.devices import sglang_share
from rlfw.config.schema import RLConfig
from rlfw.errors import ConfigError
from rlfw.ft.faults import CELL_ONLY_PHASES
from rlfw.megatron.model import RECOMPUTE, RECOMPUTE_MODULES


def _choice(key: str, value, options) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {sorted(options)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def validate(cfg: DictConfig | RLConfig, num_devices: int | None = None) -> None:
    """Raise ConfigError naming the first key whose value cannot work."""
    _check_architecture_set(cfg.model)
    _choice("dp.mode", cfg.dp.mode, {"classic", "cells"})
    _choice("ft.host_transport", cfg.ft.host_transport, {"shm", "gloo"})
    _positive("dp.size", cfg.dp.size)
    _positive("dp.num_cells", cfg.dp.num_cells)
    _positive("dp.tp", cfg.dp.tp)
    if cfg.dp.pp != 1:
        raise ConfigError(f"dp.pp={cfg.dp.pp}: pipeline parallelism is not supported yet; use dp.pp=1")
    replicas = cfg.dp.size if cfg.dp.mode == "classic" else cfg.dp.num_cells
    ranks = replicas * cfg.dp.tp * cfg.dp.pp
    share = cfg.cluster.gpus_per_worker
    if not 0 < share <= 1:
        raise ConfigError(f"cluster.gpus_per_worker={share} must be in (0, 1]: a trainer rank uses one GPU or a share")
    if share < 1 and (cfg.dp.mode != "cells" or cfg.dp.tp * cfg.dp.pp != 1):
        raise ConfigError(
            f"cluster.gpus_per_worker={share} shares a GPU between ranks, which only cells of one rank can do "
            "(dp=cells, dp.tp=1): NCCL cannot place two ranks of one world on one GPU"
        )
    if num_devices is not None and ranks * share > num_devices:
        key = "dp.size" if cfg.dp.mode == "classic" else "dp.num_cells"
        raise ConfigError(
            f"{key}={replicas} x dp.tp={cfg.dp.tp} x dp.pp={cfg.dp.pp} ranks x cluster.gpus_per_worker={share} "
            f"needs {ranks * share:g} GPUs but {num_devices} are visible; lower {key} or dp.tp, share GPUs "
            "(cluster.gpus_per_worker=0.5, cells only), or use cluster.device=cpu"
        )
    _choice("cluster.placement", cfg.cluster.placement, {"separate", "colocated"})
    _positive("rollout.gpus_per_engine", cfg.rollout.gpus_per_engine)
    _positive("rollout.max_batch", cfg.rollout.max_batch, allow_zero=True)
    if cfg.cluster.placement == "colocated" and cfg.loop.mode == "async":
        raise ConfigError(
            "cluster.placement=colocated hands the GPU's memory between generation and training, which loop=async "
            "runs at the same time; use loop=sync, or cluster.placement=separate (engines and trainers may still "
            "share a GPU through shares: cluster.gpus_per_worker=0.5 rollout.gpus_per_engine=0.5)"
        )
    engine_gpus = cfg.rollout.num_engines * cfg.rollout.gpus_per_engine
    if (num_devices is not None and cfg.rollout.backend == "local" and cfg.cluster.placement == "separate"
            and ranks * share + engine_gpus > num_devices):
        raise ConfigError(
            f"cluster.placement=separate: {ranks * share:g} GPUs of trainer ranks plus rollout.num_engines="
            f"{cfg.rollout.num_engines} x rollout.gpus_per_engine={cfg.rollout.gpus_per_engine:g} need "
            f"{ranks * share + engine_gpus:g} GPUs but {num_devices} are visible; use cluster.placement=colocated "
            "(engines on the trainers' GPUs, memory handed over between phases) or lower those keys"
        )
    if cfg.model.num_attention_heads % cfg.dp.tp or cfg.model.num_query_groups % cfg.dp.tp:
        raise ConfigError(
            f"dp.tp={cfg.dp.tp} must divide model.num_attention_heads={cfg.model.num_attention_heads} "
            f"and model.num_query_groups={cfg.model.num_query_groups}"
        )
    if cfg.dp.mode == "cells" and cfg.ft.min_cells > cfg.dp.num_cells:
        raise ConfigError(f"ft.min_cells={cfg.ft.min_cells} exceeds dp.num_cells={cfg.dp.num_cells}")

    _choice("split.when", cfg.split.when, {"rollout", "train"})
    _choice("split.how", cfg.split.how, {"strided", "balanced"})
    _positive("split.attention_weight", cfg.split.attention_weight, allow_zero=True)

    _choice("rollout.backend", cfg.rollout.backend, {"local", "vllm", "sglang"})
    if cfg.rollout.backend == "vllm":
        _check_vllm(cfg, num_devices)
    _choice("rollout.weight_transport", cfg.rollout.weight_transport, {"auto", "host", "device"})
    if cfg.rollout.weight_transport == "device" and (cfg.rollout.backend != "local" or cfg.cluster.device == "cpu"
                                                     or (cfg.cluster.device == "auto" and num_devices == 0)):
        raise ConfigError(
            "rollout.weight_transport=device hands the weights over in GPU memory, to the local engine on CUDA; "
            f"this run has rollout.backend={cfg.rollout.backend} and cluster.device={cfg.cluster.device}"
            f"{'' if num_devices is None else f' ({num_devices} GPUs visible)'}: use host or auto"
        )
    _positive("rollout.num_prompts", cfg.rollout.num_prompts)
    _positive("rollout.n_samples_per_prompt", cfg.rollout.n_samples_per_prompt)
    _positive("rollout.temperature", cfg.rollout.temperature, allow_zero=True)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    _positive("rollout.max_new_tokens", cfg.rollout.max_new_tokens, allow_zero=True)
    _positive("rollout.num_engines", cfg.rollout.num_engines)
    _positive("rollout.cpus_per_engine", cfg.rollout.cpus_per_engine)
    _positive("rollout.max_inflight_requests", cfg.rollout.max_inflight_requests, allow_zero=True)
    _positive("rollout.max_engine_restarts", cfg.rollout.max_engine_restarts, allow_zero=True)
    _positive("rollout.engine_call_timeout_s", cfg.rollout.engine_call_timeout_s)
    if cfg.rollout.step_timeout_s <= cfg.rollout.engine_call_timeout_s:
        raise ConfigError(
            f"rollout.step_timeout_s={cfg.rollout.step_timeout_s:g} must exceed rollout.engine_call_timeout_s="
            f"{cfg.rollout.engine_call_timeout_s:g}: a hung engine must be replaced before the driver gives up"
        )
    _positive("rollout.max_oversample_rounds", cfg.rollout.max_oversample_rounds, allow_zero=True)
    if cfg.rollout.dynamic_sampling and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            "rollout.dynamic_sampling=true needs rollout.n_samples_per_prompt >= 2: a group of one sample never has "
            "reward variance, so every group would be dropped"
        )
    if cfg.rollout.backend == "sglang":
        _check_sglang(cfg.rollout.sglang, cfg.rollout.num_engines)
        sglang_share(cfg)  # colocated: the server's bound on the GPU it shares with the trainers

    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "max_seq_len", "head_dim", "vocab_size"):
        value = cfg.model[key] if isinstance(cfg, DictConfig) else getattr(cfg.model, key)
        if value is not None:  # head_dim and vocab_size may stay None: derived from other keys
            _positive(f"model.{key}", value)
    if cfg.model.head_dim is None and cfg.model.hidden_size % cfg.model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={cfg.model.hidden_size} is not divisible by "
            f"model.num_attention_heads={cfg.model.num_attention_heads}; set model.head_dim"
        )
    if cfg.model.vocab_size is not None and cfg.model.vocab_size % cfg.dp.tp:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is not divisible by dp.tp={cfg.dp.tp}: every tensor-parallel "
            f"rank holds an equal slice of the embedding"
        )
    if cfg.model.rope_scaling_factor is not None:
        _positive("model.rope_scaling_factor", cfg.model.rope_scaling_factor)
    if cfg.model.qkv_bias and cfg.model.qk_layernorm:
        raise ConfigError(
            "model.qkv_bias and model.qk_layernorm are both true: no supported HF family has both "
            "(Qwen2 has q/k/v biases, Qwen3 q/k norms)"
        )
    if cfg.model.num_attention_heads % cfg.model.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={cfg.model.num_query_groups} must divide "
            f"model.num_attention_heads={cfg.model.num_attention_heads}"
        )
    _choice("model.recompute", cfg.model.recompute, RECOMPUTE)
    if cfg.model.recompute == "selective" and (
        not cfg.model.recompute_modules or set(cfg.model.recompute_modules) - set(RECOMPUTE_MODULES)
    ):
        raise ConfigError(f"model.recompute_modules={list(cfg.model.recompute_modules)} must be a non-empty subset "
                          f"of {list(RECOMPUTE_MODULES)} with model.recompute=selective")

    _validate_algo_options(cfg)
    _choice("algo.old_logprobs", cfg.algo.old_logprobs, {"auto", "recompute"})
    _positive("algo.lr", cfg.algo.lr)
    _positive("algo.grad_clip", cfg.algo.grad_clip, allow_zero=True)
    _positive("algo.global_batch_size", cfg.algo.global_batch_size, allow_zero=True)
    _positive("algo.head_chunk_tokens", cfg.algo.head_chunk_tokens)
    if cfg.algo.max_tokens_per_microbatch < cfg.model.max_seq_len:
        raise ConfigError(
            f"algo.max_tokens_per_microbatch={cfg.algo.max_tokens_per_microbatch} is below "
            f"model.max_seq_len={cfg.model.max_seq_len}: a full-length sample would not fit in a micro-batch"
        )

    _positive("num_steps", cfg.num_steps)
    _choice("loop.mode", cfg.loop.mode, {"sync", "async"})
    _positive("loop.max_staleness", cfg.loop.max_staleness, allow_zero=True)
    if cfg.loop.mode == "sync" and cfg.loop.max_staleness:
        raise ConfigError(f"loop.max_staleness={cfg.loop.max_staleness} needs loop=async: the synchronous loop trains "
                          "every step on a rollout of its own weights")
    _positive("cluster.cpus_per_worker", cfg.cluster.cpus_per_worker)
    _choice("cluster.device", cfg.cluster.device, {"auto", "cpu", "cuda"})
    _choice("cluster.cell_placement", cfg.cluster.cell_placement, {"spread", "pack"})
    for key, value in (("cluster.trainer_label_selector", cfg.cluster.trainer_label_selector),
                       ("rollout.engine_label_selector", cfg.rollout.engine_label_selector)):
        try:
            parse_labels(value)
        except ValueError as e:
            raise ConfigError(f"{key}={value!r}: {e}") from None
    try:
        check_rule(str(cfg.cluster.host))
    except AddressError as e:
        raise ConfigError(str(e)) from None

    _choice("fault.kind", cfg.fault.kind, {"none", "kill_once", "random"})
    if cfg.fault.kind != "none" and cfg.dp.mode == "classic":  # a death ends a classic job, as in real life
        replicas = cfg.dp.size
        for index, entry in enumerate([cfg.fault] + list(cfg.fault.extra_kills)):
            name = "fault" if index == 0 else f"fault.extra_kills[{index - 1}]"
            if entry.get("phase") in CELL_ONLY_PHASES:
                raise ConfigError(f"{name}.phase={entry.get('phase')!r} needs dp=cells: a classic world never heals")
            if cfg.fault.kind == "kill_once" and entry.get("cell", 0) >= replicas:
                raise ConfigError(f"{name}.cell={entry.get('cell')} names no replica of dp=classic dp.size={replicas}")
    _choice("fault.role", cfg.fault.role, {"actor", "critic"})
    for index, entry in enumerate([cfg.fault] + list(cfg.fault.extra_kills)):
        name = "fault" if index == 0 else f"fault.extra_kills[{index - 1}]"
        how, duration = entry.get("signal", cfg.fault.signal), entry.get("duration_s", cfg.fault.duration_s)
        _choice(f"{name}.signal", how, {"kill", "stop"})
        if how == "stop" and not duration > 0:
            raise ConfigError(f"{name}.signal='stop' needs {name}.duration_s > 0 (how long the cell stays stopped)")
    if cfg.fault.role == "critic" and cfg.algo.name != "ppo":
        raise ConfigError(f"fault.role='critic' needs algo=ppo: algo.name={cfg.algo.name!r} has no critic")
    _validate_ft_timeouts(cfg)
    _positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last, allow_zero=True)
    if not cfg.resume:
        raise ConfigError("resume is empty: use resume=none, resume=auto or resume=<checkpoint dir>")

    _choice_list("logger.backends", cfg.logger.backends, {"jsonl", "console", "wandb"})
    _choice("logger.wandb_mode", cfg.logger.wandb_mode, {"auto", "online", "offline", "disabled"})
    if "_target_" not in cfg.task:
        raise ConfigError("task has no _target_: pick a task (task=copy) or give task._target_=module.Class")


def _validate_ft_timeouts(cfg) -> None:
    """The order the fault-tolerance timeouts must fire in, so that a survivor never dies only because a peer's
    death or a replacement takes long to be noticed or to arrive."""
    ft = cfg.ft
    for key in ("heartbeat_timeout_s", "join_timeout_s", "stall_timeout_s", "phase_timeout_factor",
                "min_phase_timeout_s", "first_call_timeout_s", "quorum_timeout_s", "collective_timeout_s",
                "heal_min_bandwidth_mb_s", "replacement_deadline_s", "writer_timeout_s"):
        _positive(f"ft.{key}", ft[key] if isinstance(ft, DictConfig) else getattr(ft, key))
    _positive("ft.await_replacement_s", ft.await_replacement_s, allow_zero=True)
    _positive("ft.replacement_backoff_s", ft.replacement_backoff_s, allow_zero=True)
    _positive("ft.max_state_restores", ft.max_state_restores, allow_zero=True)
    if ft.max_replacements < -1:
        raise ConfigError(f"ft.max_replacements={ft.max_replacements} must be >= 0, or -1 for no limit")
    lapse = ft.heartbeat_timeout_s + ft.join_timeout_s
    if ft.quorum_timeout_s <= lapse:
        raise ConfigError(
            f"ft.quorum_timeout_s={ft.quorum_timeout_s:g} must exceed ft.heartbeat_timeout_s={ft.heartbeat_timeout_s:g}"
            f" + ft.join_timeout_s={ft.join_timeout_s:g}: the survivors' quorum must outlast the heartbeat that "
            "drops a dead cell from it"
        )
    if ft.min_phase_timeout_s <= ft.stall_timeout_s:
        raise ConfigError(
            f"ft.min_phase_timeout_s={ft.min_phase_timeout_s:g} must exceed ft.stall_timeout_s={ft.stall_timeout_s:g}:"
            " a stalled cell is failed by its silent heartbeat; a phase deadline is for cells that beat but are slow"
        )
    if ft.first_call_timeout_s < ft.min_phase_timeout_s:
        raise ConfigError(
            f"ft.first_call_timeout_s={ft.first_call_timeout_s:g} must be at least ft.min_phase_timeout_s="
            f"{ft.min_phase_timeout_s:g}: a phase's first call (warm-up) is its slowest"
        )
    if ft.phase_timeout_factor < 1:
        raise ConfigError(f"ft.phase_timeout_factor={ft.phase_timeout_factor:g} must be >= 1: a deadline below the "
                          "measured time of a phase fails healthy cells")
    if cfg.dp.mode == "cells" and ft.min_cells >= 2 and ft.replace_failed and \
            ft.quorum_timeout_s <= ft.replacement_deadline_s:
        raise ConfigError(
            f"ft.quorum_timeout_s={ft.quorum_timeout_s:g} must exceed ft.replacement_deadline_s="
            f"{ft.replacement_deadline_s:g} with ft.min_cells={ft.min_cells}: below min_cells the survivors wait in "
            "their quorum for a replacement, and the driver, not their timeout, must decide when to give up"
        )


def _check_architecture_set(model) -> None:
    """Architecture keys left None (``model=hf``) must have been read from ``model.hf_path`` before validation."""
    if model.hf_path is not None and not Path(model.hf_path).is_dir():
        raise ConfigError(f"model.hf_path={model.hf_path!r} is not a directory (only local checkpoints load)")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "rope_theta", "norm_epsilon", "qkv_bias", "qk_layernorm", "tie_word_embeddings"):
        if getattr(model, key) is None:
            raise ConfigError(
                f"model.{key} is not set and model.hf_path names no checkpoint to read it from "
                f"(model=hf needs model.hf_path=/path/to/checkpoint)"
            )


# Head sizes vLLM 0.32's CPU attention supports (vllm/v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _check_vllm(cfg, num_devices: int | None) -> None:
    """rollout=vllm: the package is installed, and on CPU the attention head size is one vLLM has kernels for."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.backend='vllm' needs vLLM: install the extra (make test does; or make run ARGS=rollout=vllm; "
            "or pip install -e '.[vllm]' then pip uninstall -y torchvision torchaudio torchcodec triton)"
        )
    _positive("rollout.kv_cache_gb", cfg.rollout.kv_cache_gb)
    on_cpu = cfg.cluster.device == "cpu" or (cfg.cluster.device == "auto" and not num_devices)
    head_dim = cfg.model.head_dim or cfg.model.hidden_size // cfg.model.num_attention_heads
    if on_cpu and head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ConfigError(
            f"model.head_dim={head_dim} (hidden_size / num_attention_heads unless set): vLLM's CPU attention "
            f"supports only {list(VLLM_CPU_HEAD_DIMS)}; change the model or use rollout=local"
        )


def _check_sglang(sglang, num_engines: int) -> None:
    """rollout.sglang: attach (urls, optionally a router in front of them) or launch (num_engines servers)."""
    _choice("rollout.sglang.weight_sync", sglang.weight_sync, {"disk", "tensor", "distributed"})
    if sglang.weight_sync == "distributed":
        raise ConfigError(
            "rollout.sglang.weight_sync=distributed (NCCL broadcast to the servers) is not implemented; use disk "
            "or tensor (servers on the engines' nodes)"
        )
    for url in sglang.urls:
        _check_url("rollout.sglang.urls", url)
    if len(set(sglang.urls)) != len(sglang.urls):
        raise ConfigError(f"rollout.sglang.urls={list(sglang.urls)} names a server twice")
    if sglang.urls and num_engines != len(sglang.urls):
        raise ConfigError(
            f"rollout.num_engines={num_engines} but rollout.sglang.urls lists {len(sglang.urls)} servers: one engine "
            f"drives one server; set rollout.num_engines={len(sglang.urls)}"
        )
    if sglang.router_url is not None:
        _check_url("rollout.sglang.router_url", sglang.router_url)
        if not sglang.urls:
            raise ConfigError(
                "rollout.sglang.router_url needs rollout.sglang.urls: the servers behind the router, which rlfw "
                "pushes the weights to (a router does not forward weight updates)"
            )
    if not sglang.urls:  # launch mode
        _positive("rollout.num_engines", num_engines)
        if not sglang.launch_command:
            raise ConfigError("rollout.sglang.launch_command is empty: give the server program")
        if not 1 <= sglang.base_port <= 65536 - num_engines:
            raise ConfigError(
                f"rollout.sglang.base_port={sglang.base_port}: ports base_port..base_port+rollout.num_engines-1 "
                "must lie in 1..65535"
            )
        _positive("rollout.sglang.gpus_per_engine", sglang.gpus_per_engine, allow_zero=True)
    for key in ("startup_timeout_s", "request_timeout_s", "weight_update_timeout_s", "control_timeout_s"):
        _positive(f"rollout.sglang.{key}", sglang[key] if isinstance(sglang, DictConfig) else getattr(sglang, key))
    _positive("rollout.sglang.max_retries", sglang.max_retries, allow_zero=True)
    _positive("rollout.sglang.retry_backoff_s", sglang.retry_backoff_s, allow_zero=True)


def _check_url(key: str, url: str) -> None:
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise ConfigError(f"{key}: {url!r} is not a server URL like http://127.0.0.1:30000")


def _validate_algo_options(cfg) -> None:
    """The advantage estimator, the options that belong to it alone, and the loss options (``rlfw.algo``)."""
    algo = cfg.algo
    _choice("algo.name", algo.name, set(ESTIMATORS))
    estimator = ESTIMATORS[algo.name]
    for option in ESTIMATOR_OPTIONS:
        value = getattr(algo, option)
        if option in estimator.options:
            _choice(f"algo.{option}", value, set(estimator.options[option]))
        elif value is not None:
            owners = sorted(name for name, e in ESTIMATORS.items() if option in e.options)
            raise ConfigError(f"algo.{option}={value!r} does not apply to algo.name={algo.name!r} (only to {owners})")
    if estimator.uses_groups(algo) and cfg.rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.n_samples_per_prompt={cfg.rollout.n_samples_per_prompt}: algo.name={algo.name!r} compares "
            f"samples of one prompt, so it needs at least 2 (with 1 every advantage is 0)"
        )
    if algo.turn_discount is not None:
        if algo.name not in TURN_CREDIT_ESTIMATORS:
            raise ConfigError(f"algo.turn_discount={algo.turn_discount} does not apply to algo.name={algo.name!r} "
                              f"(only to {list(TURN_CREDIT_ESTIMATORS)})")
        if not 0 <= algo.turn_discount <= 1:
            raise ConfigError(f"algo.turn_discount={algo.turn_discount} must be in [0, 1], or null for none")
    _choice("algo.loss_agg", algo.loss_agg, set(LOSS_AGGREGATIONS))
    _choice("algo.kl_estimator", algo.kl_estimator, set(KL_ESTIMATORS))
    _choice("algo.on_nonfinite", algo.on_nonfinite, {"stop", "skip"})
    for key in ("clip_eps_low", "clip_eps_high", "kl_loss_coef", "kl_reward_coef", "entropy_coef"):
        _positive(f"algo.{key}", getattr(algo, key), allow_zero=True)
    if algo.dual_clip_c != 0 and algo.dual_clip_c <= 1:
        raise ConfigError(f"algo.dual_clip_c={algo.dual_clip_c} must be > 1 (the cap is c times |A|), or 0 for off")
    if algo.tis_cap != 0 and algo.tis_cap < 1:
        raise ConfigError(f"algo.tis_cap={algo.tis_cap} must be >= 1 (an on-policy token weighs 1), or 0 for off")
    _validate_ppo(cfg)


def _validate_ppo(cfg) -> None:
    """GAE options only with ppo, in [0, 1]; the critic's own options; the critic pairs with the policy."""
    algo = cfg.algo
    for key in ("gamma", "gae_lambda"):
        value = getattr(algo, key)
        if algo.name != "ppo":
            if value is not None:
                raise ConfigError(f"algo.{key}={value} does not apply to algo.name={algo.name!r} (only to ['ppo'])")
        elif value is None or not 0 <= value <= 1:
            raise ConfigError(f"algo.{key}={value} must be in [0, 1] for algo.name='ppo'")
    if algo.name != "ppo":
        return
    _positive("algo.critic.lr", algo.critic.lr)
    _positive("algo.critic.value_clip", algo.critic.value_clip, allow_zero=True)
    # The critic group has the policy's dp mode and replica count: actor replica (cell) i pairs with critic i.
    replicas = cfg.dp.size if cfg.dp.mode == "classic" else cfg.dp.num_cells
    if algo.critic.num_replicas is not None and algo.critic.num_replicas != replicas:
        raise ConfigError(
            f"algo.critic.num_replicas={algo.critic.num_replicas} must equal the policy's {replicas} replicas "
            f"(dp.{'size' if cfg.dp.mode == 'classic' else 'num_cells'}): actor replica i pairs with critic replica i"
        )


def _choice_list(key: str, values, options) -> None:
    for value in values:
        _choice(key, value, options)
