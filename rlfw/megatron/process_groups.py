"""A rank's torch.distributed world and Megatron's model-parallel groups, each under a timeout the caller chooses.

Megatron builds its tensor-, pipeline- and data-parallel groups with a timeout of its own (30 minutes unless told),
not the default group's. The caller knows what its groups wait for: inside a cell they only carry the tensor- and
pipeline-parallel collectives of one forward/backward, so a peer that misses one for a collective timeout is stalled
and should release the others; a classic world's data-parallel group also waits for the slowest rank's whole
forward/backward, which a short timeout would turn into a lost world.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def join_world(store: dist.Store, rank: int, world_size: int, device: torch.device, *, tp: int, pp: int,
               timeout_s: float, groups_timeout_s: float) -> None:
    """Join the default process group (Gloo on CPU, NCCL on CUDA; collectives end after ``timeout_s``) and build
    Megatron's groups over it (theirs after ``groups_timeout_s``)."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    parallel_state.initialize_model_parallel(tp, pp, distributed_timeout_minutes=groups_timeout_s / 60)
