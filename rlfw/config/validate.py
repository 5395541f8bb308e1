"""Cross-field checks that a typed schema cannot express; run before Ray starts."""

from __future__ import annotations

import ipaddress

from omegaconf import DictConfig

from rlfw.config.schema import RLConfig


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and says what to change."""


def _choice(key: str, value, options) -> None:
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of {sorted(options)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


def validate(cfg: DictConfig | RLConfig, num_devices: int | None = None) -> None:
    """Raise ConfigError naming the first key whose value cannot work."""
    _choice("dp.mode", cfg.dp.mode, {"classic", "cells"})
    _positive("dp.size", cfg.dp.size)
    _positive("dp.num_cells", cfg.dp.num_cells)
    _positive("dp.tp", cfg.dp.tp)
    if cfg.dp.pp != 1:
        raise ConfigError(f"dp.pp={cfg.dp.pp}: pipeline parallelism is not supported yet; use dp.pp=1")
    replicas = cfg.dp.size if cfg.dp.mode == "classic" else cfg.dp.num_cells
    ranks = replicas * cfg.dp.tp * cfg.dp.pp
    if num_devices is not None and ranks > num_devices:
        key = "dp.size" if cfg.dp.mode == "classic" else "dp.num_cells"
        raise ConfigError(
            f"{key}={replicas} x dp.tp={cfg.dp.tp} x dp.pp={cfg.dp.pp} needs {ranks} GPUs but {num_devices} are "
            f"visible; lower {key} or dp.tp, or use cluster.device=cpu"
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
    if cfg.rollout.backend != "local":
        raise ConfigError(
            f"rollout.backend={cfg.rollout.backend!r} is reserved but not implemented yet; use rollout=local"
        )
    _positive("rollout.num_prompts", cfg.rollout.num_prompts)
    _positive("rollout.n_samples_per_prompt", cfg.rollout.n_samples_per_prompt)
    _positive("rollout.temperature", cfg.rollout.temperature, allow_zero=True)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    _positive("rollout.max_new_tokens", cfg.rollout.max_new_tokens, allow_zero=True)

    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "max_seq_len"):
        _positive(f"model.{key}", cfg.model[key] if isinstance(cfg, DictConfig) else getattr(cfg.model, key))
    if cfg.model.hidden_size % cfg.model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={cfg.model.hidden_size} is not divisible by "
            f"model.num_attention_heads={cfg.model.num_attention_heads}"
        )
    if cfg.model.num_attention_heads % cfg.model.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={cfg.model.num_query_groups} must divide "
            f"model.num_attention_heads={cfg.model.num_attention_heads}"
        )

    _choice("algo.name", cfg.algo.name, {"grpo"})
    _choice("algo.loss_agg", cfg.algo.loss_agg, {"token_mean", "sample_mean"})
    _positive("algo.lr", cfg.algo.lr)
    _positive("algo.clip_eps_low", cfg.algo.clip_eps_low, allow_zero=True)
    _positive("algo.clip_eps_high", cfg.algo.clip_eps_high, allow_zero=True)
    _positive("algo.kl_coef", cfg.algo.kl_coef, allow_zero=True)
    _positive("algo.grad_clip", cfg.algo.grad_clip, allow_zero=True)
    _positive("algo.global_batch_size", cfg.algo.global_batch_size, allow_zero=True)
    if cfg.algo.max_tokens_per_microbatch < cfg.model.max_seq_len:
        raise ConfigError(
            f"algo.max_tokens_per_microbatch={cfg.algo.max_tokens_per_microbatch} is below "
            f"model.max_seq_len={cfg.model.max_seq_len}: a full-length sample would not fit in a micro-batch"
        )

    _positive("num_steps", cfg.num_steps)
    _positive("cluster.cpus_per_worker", cfg.cluster.cpus_per_worker)
    _choice("cluster.device", cfg.cluster.device, {"auto", "cpu", "cuda"})
    try:
        ipaddress.ip_address(cfg.cluster.host)
    except ValueError:
        raise ConfigError(f"cluster.host={cfg.cluster.host!r} is not an IP address (e.g. 127.0.0.1)") from None

    _choice("fault.kind", cfg.fault.kind, {"none", "kill_once", "random"})
    if cfg.fault.kind != "none" and cfg.dp.mode != "cells":
        raise ConfigError(f"fault.kind={cfg.fault.kind!r} needs dp=cells: classic DP cannot survive a death")
    _positive("ft.heartbeat_timeout_s", cfg.ft.heartbeat_timeout_s)
    _positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)

    _choice_list("logger.backends", cfg.logger.backends, {"jsonl", "console", "wandb"})
    _choice("logger.wandb_mode", cfg.logger.wandb_mode, {"auto", "online", "offline", "disabled"})
    if "_target_" not in cfg.task:
        raise ConfigError("task has no _target_: pick a task (task=copy) or give task._target_=module.Class")


def _choice_list(key: str, values, options) -> None:
    for value in values:
        _choice(key, value, options)
