"""``python -m rlfw.train [overrides]``: validate the config, start Ray, build the parts, run the RL loop."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlfw.cluster.worker_setup import KNOWN_WARNINGS_ENV, setup_process
from rlfw.config import ConfigError, register_configs, validate
from rlfw.config.devices import check_gpu_memory, cluster_gpus, local_gpus, samples_per_engine
from rlfw.ft.errors import BelowMinCellsError, WorldLostError
from rlfw.loop import NothingToTrainError
from rlfw.run_files import CONFIG
from rlfw.sweep import run_sweep_job

log = logging.getLogger("rlfw")
# The job lost workers it cannot go on without (a classic rank, cells below ft.min_cells); its state is in the last
# checkpoint, so the same command with resume=auto continues (EX_TEMPFAIL: a supervisor may restart it).
EXIT_RESTARTABLE = 75
register_configs()


def build_group(cfg, vocab_size: int, role: str = "actor", load_from: Optional[str] = None):
    """The policy's train group, or (``role=critic``, algo=ppo) the value model's: same dp mode, same replicas,
    starting from the checkpoint ``load_from`` (None: the init weights)."""
    if cfg.dp.mode == "classic":
        from rlfw.train_group.classic import ClassicGroup

        return ClassicGroup(cfg, vocab_size, role, load_from)
    from rlfw.train_group.cells import CellGroup

    return CellGroup(cfg, vocab_size, role, load_from)


def train(cfg: DictConfig, run_dir: Path) -> dict:
    started = time.time()
    known_warnings = run_dir / "logs" / "known_warnings.log"  # harmless start-up warnings, off the console
    known_warnings.parent.mkdir(parents=True, exist_ok=True)
    os.environ[KNOWN_WARNINGS_ENV] = str(known_warnings)
    setup_process()  # before this process imports Megatron
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    import torch

    from rlfw.checkpoint import Checkpointer
    from rlfw.checkpoint.partial import read_partial
    from rlfw.checkpoint.resume import check_compatible, resolve_resume, rewind_step_logs
    from rlfw.cluster.ray_cluster import start_ray, stop_ray
    from rlfw.ft.errors import UnfiredFaultError
    from rlfw.ft.faults import unfired_kills
    from rlfw.ft.goodput import GoodputMeter, run_started
    from rlfw.logging import build_loggers
    from rlfw.loop import build_roles, run_loop
    from rlfw.rollout.manager import RolloutManager, padded_vocab_size
    from rlfw.train_group.worker import model_shape

    # A local run counts its GPUs now; a cluster's (its driver may have none) once Ray has joined it.
    visible_gpus = None if cfg.cluster.address else local_gpus(cfg)
    if cfg.model.hf_path:  # the unset architecture keys come from the checkpoint's config.json
        from rlfw.model.hf_checkpoint import fill_model_config

        fill_model_config(cfg.model)
    validate(cfg, num_devices=visible_gpus)
    try:  # a bad task target, argument or dataset file fails here, before Ray starts
        task = instantiate(cfg.task)
    except InstantiationException as e:
        raise ConfigError(f"task {cfg.task.get('_target_')} could not be built: {e.__cause__ or e}") from e
    vocab_size = cfg.model.vocab_size or padded_vocab_size(len(task.tokenizer), cfg.dp.tp)
    if len(task.tokenizer) > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the task's tokenizer ({len(task.tokenizer)})")
    shape = model_shape(cfg, vocab_size)
    if visible_gpus:  # the smallest GPU must hold the placement's larger phase
        check_gpu_memory(cfg, shape, min(torch.cuda.get_device_properties(i).total_memory
                                         for i in range(visible_gpus)), samples_per_engine(cfg))
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir.resolve())  # workers write the fault markers and checkpoints under it
    resume = resolve_resume(cfg.resume, Path(cfg.checkpoint.dir or run_dir / "checkpoints"))
    if resume is not None:
        check_compatible(resume, shape, cfg.num_steps, needs_critic=cfg.algo.name == "ppo")
        rewound = rewind_step_logs(run_dir, resume.step)
        inside = " inside the step (its batch is saved)" if read_partial(resume.path) else ""
        log.info("resuming from %s at step %d%s%s", resume.path, resume.step, inside,
                 f" (rewound {rewound})" if rewound else "")
    elif cfg.resume == "auto" and (rewound := rewind_step_logs(run_dir, 0)):  # a restart before the first save
        log.info("resume=auto: the steps an earlier job logged before any checkpoint are redone (rewound %s)", rewound)
    (run_dir / CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    restarting = resume is not None or cfg.resume == "auto"  # resume=auto: the run's earlier jobs count in its figures
    meter = GoodputMeter.for_run(run_dir, run_started(run_dir, restarting, started), restarting)

    start_ray(cfg.cluster, known_warnings_log=str(known_warnings))
    if cfg.cluster.address:
        try:
            validate(cfg, num_devices=cluster_gpus(cfg, ray.cluster_resources()))
        except ConfigError:
            stop_ray()
            raise
    log.info("known harmless start-up warnings (no Apex or Transformer Engine on this machine, etc.) go to %s",
             known_warnings)
    loggers = build_loggers(
        list(cfg.logger.backends), run_dir, cfg.num_steps,
        dict(project=cfg.logger.wandb_project, group=cfg.logger.wandb_group, name=run_dir.name,
             config=OmegaConf.to_container(cfg, resolve=True), mode=cfg.logger.wandb_mode,
             run_id=resume.wandb_run_id if resume else None),
    )
    group = critic = manager = None
    exit_code = 1
    try:
        # Orchestration stays with the driver (on its node, like the Lighthouse): a lost trainer node must not take
        # the rollout manager with it; the engines go where rollout.engine_label_selector says. Created first: the
        # manager and its engines start while the train group builds its worlds (nothing of one needs the other
        # before the first weight push).
        manager = RolloutManager.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)).remote(OmegaConf.to_container(cfg, resolve=True),
                                                                          shape)
        load_from = str(resume.path) if resume is not None else None
        group = build_group(cfg, vocab_size, load_from=load_from)
        if cfg.algo.name == "ppo":
            critic = build_group(cfg, vocab_size, role="critic", load_from=load_from)
        roles = build_roles(cfg.algo, group, critic)
        checkpointer = Checkpointer(cfg, roles, run_dir, shape, run_info=lambda: {"wandb_run_id": loggers.run_id},
                                    origin=resume)
        if resume is not None:
            loggers.event("resumed", resume.step, checkpoint=str(resume.path), saved_layout=resume.meta["layout"])
        start_step = resume.step if resume else 0
        metrics = run_loop(cfg, roles, manager, loggers, run_dir, checkpointer, started, start_step,
                           resumed=read_partial(resume.path) if resume else None, meter=meter)
        missed = unfired_kills(cfg.fault, cfg.run_dir)
        if missed:
            raise UnfiredFaultError(
                f"the run finished but {len(missed)} scheduled kills never fired: {missed} (no process reached that "
                "cell, incarnation and phase at or after that step); change fault.* so the fault can happen"
            )
        exit_code = 0
        return metrics
    finally:
        loggers.finish(exit_code)
        if manager is not None:
            try:  # a manager whose start failed must not hide the error that ends the run
                ray.get(manager.shutdown.remote(), timeout=cfg.rollout.step_timeout_s)
            except Exception as e:  # noqa: BLE001
                log.warning("the rollout manager did not shut down cleanly: %r", e)
        if group is not None:
            group.shutdown()
        if critic is not None:
            critic.shutdown()
        stop_ray()  # a job of hydra/launcher=ray leaves the shared cluster running


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(cfg.run_dir or hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        if cfg.logger.wandb_group is None:
            cfg.logger.wandb_group = Path(hydra_cfg.sweep.dir).name  # one W&B group per sweep
        metrics = run_sweep_job(lambda: train(cfg, run_dir), run_dir)  # a failed job is recorded; the sweep goes on
        if metrics is None:
            return float("nan")
    else:
        try:
            metrics = train(cfg, run_dir)
        except ConfigError as e:
            log.error("config error: %s", e)
            sys.exit(2)
        except NothingToTrainError as e:
            log.error("cannot train: %s", e)
            sys.exit(1)
        except (WorldLostError, BelowMinCellsError) as e:  # workers lost for good; the state is on disk
            log.error("job lost: %s", e)
            sys.exit(EXIT_RESTARTABLE)
    log.info("run finished: %s (reward/mean %.3f)", run_dir, metrics.get("reward/mean", float("nan")))
    return metrics.get("reward/mean", float("nan"))  # the value Hydra sweepers optimise


if __name__ == "__main__":
    main()
