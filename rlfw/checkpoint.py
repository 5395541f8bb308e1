"""Checkpoints written by the writer replica: atomically (temp dir + rename + COMPLETE marker) or not at all.

A job killed mid-save leaves the previous checkpoint intact and a ``*.tmp`` directory without a COMPLETE marker.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch

COMPLETE = "COMPLETE"


def write_checkpoint(path: Path, state: Dict[str, Any], before_commit=None) -> None:
    """Write ``state`` to ``path/state.pt``; ``before_commit`` runs after the data is on disk, before the rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if before_commit is not None:
        before_commit()
    (tmp / COMPLETE).write_text("ok\n")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


class Checkpointer:
    """Asks the train group's writer to save every ``interval`` steps and at the end of the run."""

    def __init__(self, cfg, group, run_dir: Path):
        self.group = group
        self.interval = cfg.checkpoint.interval
        self.save_final = cfg.checkpoint.save_final
        self.root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")

    def save_now(self, steps_done: int) -> Path:
        path = self.root / f"step_{steps_done}"
        self.group.save(str(path), steps_done)
        if not (path / COMPLETE).exists():
            # dp.tp > 1: each TP rank renamed its own shard directory into place; the step is complete only now
            # that all of them returned.
            (path / COMPLETE).write_text("ok\n")
        return path

    def maybe_save(self, step: int, final: bool) -> Optional[Path]:
        if (self.interval and (step + 1) % self.interval == 0) or (final and self.save_final):
            return self.save_now(step + 1)
        return None
