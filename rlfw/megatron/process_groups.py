"""A rank's torch.distributed world and Megatron's model-parallel groups, all under one collective timeout.

Megatron builds its tensor-, pipeline- and data-parallel groups with a timeout of its own (30 minutes unless told),
not the default group's. A rank stalled inside one of those collectives would hold its peers for half an hour; every
group here ends a collective after ``timeout_s`` instead, as the default group does, so a stalled peer becomes an
error the caller can act on.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def join_world(store: dist.Store, rank: int, world_size: int, device: torch.device, *, tp: int, pp: int,
               timeout_s: float) -> None:
    """Join the default process group (Gloo on CPU, NCCL on CUDA) and build Megatron's groups over it."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    parallel_state.initialize_model_parallel(tp, pp, distributed_timeout_minutes=timeout_s / 60)
