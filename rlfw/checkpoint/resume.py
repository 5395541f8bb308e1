"""``resume=none|auto|PATH``: which checkpoint a run starts from, whether it fits, and the logs it rewinds.

``auto`` takes the newest checkpoint that verifies under ``checkpoint.dir`` (default ``<run_dir>/checkpoints``)
and starts fresh when there is none, so the same command both starts and resumes a job. A checkpoint of another
model shape is refused. The dp layout may differ: every replica holds the same state, so a checkpoint of 3 cells
resumes on 2, or on a classic world, and back.

Rollouts need no saved state: prompts and the engines' sampling seeds are functions of (seed, step), so the step
count is the data cursor; only a save inside a step keeps that step's batch (``rlfw.checkpoint.partial``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlfw.checkpoint.layout import CheckpointError, find_latest, verify
from rlfw.errors import ConfigError
from rlfw.run_files import REWOUND, STEP_LOGS

log = logging.getLogger("rlfw.checkpoint")


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int  # RL steps done: the run continues with this step
    meta: dict[str, Any]

    @property
    def wandb_run_id(self) -> str | None:
        return self.meta.get("wandb_run_id")


def resolve_resume(option: str, checkpoint_root: Path) -> ResumePoint | None:
    """The checkpoint to start from, or None to start fresh."""
    if option == "none":
        return None
    if option == "auto":
        found = find_latest(checkpoint_root)
        if found is None:
            log.info("resume=auto: no complete checkpoint under %s; starting from scratch", checkpoint_root)
            return None
        path, meta = found
    else:
        path = Path(option)
        if not path.is_dir():
            raise ConfigError(f"resume={option!r}: no such checkpoint directory")
        try:
            meta = verify(path)
        except CheckpointError as e:
            raise ConfigError(f"resume={option!r} cannot be loaded: {e}") from None
    return ResumePoint(path.resolve(), int(meta["step"]), meta)


def check_compatible(point: ResumePoint, shape, num_steps: int, needs_critic: bool = False) -> None:
    """Refuse a checkpoint the configured model cannot load, naming every field that differs."""
    saved, wanted = point.meta["model_shape"], asdict(shape)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, config {v!r}" for k, v in wanted.items() if saved.get(k) != v]
    if diffs:
        raise ConfigError(f"checkpoint {point.path} holds a different model ({'; '.join(diffs)})")
    if needs_critic and not point.meta.get("critic"):
        raise ConfigError(f"checkpoint {point.path} has no critic state (it was not saved by an algo=ppo run)")
    if point.step > num_steps:
        raise ConfigError(f"checkpoint {point.path} is at step {point.step}, past num_steps={num_steps}")


def rewind_step_logs(run_dir: Path, step: int) -> dict[str, int]:
    """Move the records of steps >= ``step`` (to be redone) from the run's step logs to ``<name>.rewound``.

    Nothing is deleted: the superseded records stay readable next to the log. Returns the count moved per file.
    """
    moved = {}
    for name in STEP_LOGS:
        path = Path(run_dir) / name
        if not path.exists():
            continue
        keep, superseded = [], []
        for line in path.read_text().splitlines(keepends=True):
            try:
                record_step = json.loads(line).get("step")
            except json.JSONDecodeError:
                record_step = None  # a line torn by the crash: superseded as well
            (superseded if record_step is None or record_step >= step else keep).append(line)
        if superseded:
            with open(path.with_name(name + REWOUND), "a") as f:
                f.writelines(superseded)
            tmp = path.with_name(name + ".tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, path)
            moved[name] = len(superseded)
    return moved
