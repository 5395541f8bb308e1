"""When to save, and the driver's half of a save: ask the writer to write, then commit (see ``layout``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfw.checkpoint.layout import commit, prune, role_dir, staging_dir, step_dir
from rlfw.checkpoint.partial import PartialStep, write_partial
from rlfw.checkpoint.resume import ResumePoint, resolve_resume


class Checkpointer:
    """Saves every ``checkpoint.interval`` steps and at the end of the run, keeping ``checkpoint.keep_last``.

    ``run_info`` returns what the driver records in rlfw.json next to the trainer's state (the W&B run id, so a
    resumed run logs into the same W&B run). Every role's group saves into the same directory (the policy at its
    top, PPO's critic into ``critic/``), so the roles are committed together or not at all.
    """

    def __init__(self, cfg, roles, run_dir: Path, shape, run_info: Callable[[], dict[str, Any]] = dict,
                 origin: ResumePoint | None = None):
        """``roles``: the run's roles (``rlfw.loop.roles``), the policy first; ``origin``: the checkpoint the job
        started from (None: the init weights)."""
        self.roles, self.origin = roles, origin
        self.interval = cfg.checkpoint.interval
        self.save_final = cfg.checkpoint.save_final
        self.keep_last = cfg.checkpoint.keep_last
        self.root = Path(cfg.checkpoint.dir or Path(run_dir) / "checkpoints")
        self.run_info = run_info
        replicas = cfg.dp.size if cfg.dp.mode == "classic" else cfg.dp.num_cells
        self.layout = {"dp_mode": cfg.dp.mode, "replicas": replicas, "tp": cfg.dp.tp}
        self.shape = dataclasses.asdict(shape)

    def save_now(self, steps_done: int, partial: PartialStep | None = None) -> Path:
        """Save ``steps_done`` complete RL steps, and with ``partial`` the one under way (``checkpoint.partial``)."""
        staging = staging_dir(self.root, steps_done)
        for role in self.roles:
            role.group.save(str(role_dir(staging, role.name)), steps_done)
        if partial is not None:
            write_partial(staging, partial)
        meta = {"step": steps_done, "model_shape": self.shape, "layout": self.layout,
                "critic": any(role.name == "critic" for role in self.roles),
                "partial_step": partial.done if partial is not None else None, **self.run_info()}
        path = commit(staging, step_dir(self.root, steps_done), meta)
        prune(self.root, self.keep_last)
        return path

    def last_state(self) -> ResumePoint | None:
        """The newest verified checkpoint of this run, else the job's own start (None: the init weights)."""
        return resolve_resume("auto", self.root) or self.origin

    def maybe_save(self, step: int, final: bool) -> Path | None:
        if (self.interval and (step + 1) % self.interval == 0) or (final and self.save_final):
            return self.save_now(step + 1)
        return None
