"""The checkpoint directory and its integrity rules.

    <root>/step_<n>/          n = RL steps done; the trainer's Megatron distributed checkpoint (model and
                              optimizer sharded by global offsets, so another TP layout can load it; cursor and RNG
                              in its common state), plus
        partial_step.pkl      only in a save inside an RL step: that step's batch (rlfw.checkpoint.partial)
        rlfw.json             step, model shape, W&B run id, dp layout, and the size and SHA-256 of every file
        COMPLETE              written last: a directory without it was never committed

The trainer ranks write into ``step_<n>.tmp``; the driver commits once all of them returned: it hashes the files
into rlfw.json, writes COMPLETE, fsyncs and renames the directory into place. A job killed at any point leaves
the previous checkpoints untouched, and a checkpoint whose files changed after the commit (a truncated copy, a
flipped byte) fails ``verify`` and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rlfw.checkpoint")

COMPLETE = "COMPLETE"
META = "rlfw.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded; the message names the directory and the reason."""


def step_dir(root: Path, steps_done: int) -> Path:
    return Path(root) / f"step_{steps_done}"


def role_dir(checkpoint: str | Path, role: str) -> Path:
    """Where a role's trainer state lies in a checkpoint: the policy's (``actor``) at its top, another role's in
    the subdirectory named after it (PPO's ``critic/``)."""
    return Path(checkpoint) if role == "actor" else Path(checkpoint) / role


def staging_dir(root: Path, steps_done: int) -> Path:
    return Path(root) / f"step_{steps_done}.tmp"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _data_files(path: Path):
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name not in (META, COMPLETE))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(staging: Path, final: Path, meta: dict[str, Any]) -> Path:
    """Seal a fully written staging directory and move it to ``final`` (replacing an older one of that name)."""
    staging, final = Path(staging), Path(final)
    files = {str(p.relative_to(staging)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in
             _data_files(staging)}
    if not files:
        raise CheckpointError(f"{staging}: nothing was written; refusing to commit an empty checkpoint")
    record = {"format_version": FORMAT_VERSION, "saved_at": time.time(), **meta, "files": files}
    (staging / META).write_text(json.dumps(record, indent=1, sort_keys=True))
    for p in [*_data_files(staging), staging / META]:
        _fsync(p)
    (staging / COMPLETE).write_text("ok\n")
    _fsync(staging / COMPLETE)
    _fsync(staging)
    if final.exists():  # the same step saved again (an emergency save): swap. A crash between the two renames
        old = _swapped_out(final)  # leaves the earlier save as step_<n>.old, which find_latest puts back.
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    _fsync(final.parent)
    return final


def read_meta(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not (path / COMPLETE).exists():
        raise CheckpointError(f"{path}: no {COMPLETE} marker (the save never finished)")
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/{META} is unreadable: {e}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta.get('format_version')}, expected {FORMAT_VERSION}")
    return meta


def verify(path: Path) -> dict[str, Any]:
    """The checkpoint's meta if every file is as committed; CheckpointError naming the first difference."""
    path = Path(path)
    meta = read_meta(path)
    for name, expected in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: file {name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"{path}: {name} has {file.stat().st_size} bytes, {expected['bytes']} committed")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{path}: {name} differs from what was committed (SHA-256 mismatch)")
    return meta


def list_steps(root: Path):
    """(steps done, directory) of every ``step_<n>`` directory under ``root``, newest first."""
    found = []
    for p in Path(root).glob("step_*"):
        suffix = p.name[len("step_"):]
        if p.is_dir() and suffix.isdigit():
            found.append((int(suffix), p))
    return sorted(found, reverse=True)


def _swapped_out(final: Path) -> Path:
    return final.with_name(final.name + ".old")


def _finish_interrupted_swaps(root: Path) -> None:
    """A crash inside ``commit``'s swap leaves ``step_<n>.old``: without ``step_<n>`` it is the only copy of that
    step, put back; beside a ``step_<n>`` the swap got through and it is removed."""
    for old in Path(root).glob("step_*.old"):
        final = old.with_name(old.name[:-len(".old")])
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            log.warning("%s: a save of the same step was interrupted mid-swap; the earlier save is put back", final)
            os.replace(old, final)


def find_latest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that verifies (after finishing a swap a crash interrupted); older ones
    are tried in turn, each skip logged."""
    _finish_interrupted_swaps(root)
    for _, path in list_steps(root):
        try:
            return path, verify(path)
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
    return None


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the ``keep_last`` newest committed checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return
    committed = [path for _, path in list_steps(root) if (path / COMPLETE).exists()]
    for path in committed[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
