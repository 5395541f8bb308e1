"""The trainer side of a checkpoint: Megatron distributed checkpointing of model and optimizer, plus common state.

Every rank of the saving world calls ``save_state`` (it is a collective over that world: in a classic world all
data-parallel ranks join and Megatron writes each shard once; in cells mode it is the writer cell's ranks).
Tensors are saved by their global offsets, so a checkpoint written by one TP layout loads into another, and one
replica's state loads into any number of replicas or cells.

No RNG state is saved: training draws no random numbers (no dropout), and rollout sampling is seeded by
(seed, step), so a resumed run repeats the uninterrupted one without it.
"""

from __future__ import annotations

import queue
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _sharded_state(trainer, is_loading: bool) -> dict[str, Any]:
    model = trainer.model.module.sharded_state_dict()
    return {"model": model, "optimizer": trainer.optimizer.sharded_state_dict(model, is_loading=is_loading)}


def collect_write_results_in_process() -> None:
    """Megatron's torch_dist writer hands the written files' results back through a queue made for async saves,
    whose caller is another process: a ``multiprocessing.Manager`` queue, that is a spawned Python server in every
    process that saves. rlfw saves synchronously (the queue is filled and emptied in this process), so a plain
    queue serves; the server cost a Python start-up (imports included) at each trainer's first save, and it outlived
    a trainer SIGKILLed while holding it. Megatron reads its module-global ``_results_queue`` (every release so
    far); tests/megatron/test_checkpoint_state.py pins that a save starts no such server."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(getattr(filesystem_async, "_results_queue", None), queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def save_state(path: str, trainer, common: dict[str, Any]) -> None:
    """Write this world's state into the (staging) directory ``path``; rank 0 empties it first."""
    from megatron.core import dist_checkpointing

    collect_write_results_in_process()
    path = Path(path)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # a previous attempt (a failed writer) may have left files
        path.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({**_sharded_state(trainer, is_loading=False), "common": common}, str(path))


def load_state(path: str, trainer) -> dict[str, Any]:
    """Load model and optimizer into this rank (a collective over its world); returns the common state."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded_state(trainer, is_loading=True), str(path))
    trainer.model.module.load_state_dict(loaded["model"])
    trainer.optimizer.load_state_dict(loaded["optimizer"])
    return loaded["common"]


def read_model_weights(path: str) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) tensors from a checkpoint, without a process group: for export and tests.

    Keys are Megatron's checkpoint keys (the layers of one kind stacked along a leading dim).
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    state = _load_state_dict_from_keys(checkpoint_id=str(path))
    return {k: v for k, v in state.items() if not k.startswith("optimizer.") and isinstance(v, torch.Tensor)}
