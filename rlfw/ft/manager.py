"""A torchft Manager per trainer rank, kept on the configured interface.

torchft's Manager hard-codes its ManagerServer bind to ``[::]:port`` (all interfaces); rlfw binds the host it was
configured with instead (``rlfw.ft.torchft_api.manager_server_bound_to``). Heals use the
process-group transport (state sent over the cells' own Gloo/NCCL group), not torchft's HTTP server, which would
also bind all interfaces.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch

from rlfw.ft.host_shared import ProcessGroupHostShared
from rlfw.ft.torchft_api import Manager, PGTransport, ProcessGroupGloo, ProcessGroupNCCL, manager_server_bound_to


def make_manager(
    *,
    cell: int,
    group_rank: int,
    group_world_size: int,
    host: str,
    store_host: str,
    store_port: int,
    lighthouse_address: str,
    state_dict: Callable[[], dict],
    load_state_dict: Callable[[dict], None],
    min_replicas: int,
    device: torch.device,
    collective_timeout_s: float,
    quorum_timeout_s: float,
    heal_timeout_s: float,
    shared_device: bool = False,
    host_transport: str = "shm",
) -> Manager:
    """``collective_timeout_s`` bounds each collective (the process group's own timeout); ``heal_timeout_s`` the
    Manager's operations, the heal's state transfer among them, which takes as long as the state is large.
    ``host_transport`` is ft.host_transport: how cells that meet over Gloo all-reduce."""
    timeout = timedelta(seconds=collective_timeout_s)
    # NCCL cannot join two processes on one GPU: cells sharing a device meet over Gloo (CUDA tensors go through host
    # memory), and heals stage the state on the host. Their all-reduces go through shared memory where the cells
    # share a host (rlfw/ft/host_shared.py).
    gloo = device.type == "cpu" or shared_device
    if not gloo:
        pg = ProcessGroupNCCL(timeout=timeout)
    elif host_transport == "shm":
        pg = ProcessGroupHostShared(timeout=timeout)
    else:
        pg = ProcessGroupGloo(timeout=timeout)
    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu") if gloo else device)
    with manager_server_bound_to(host):
        return Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_replicas,
            use_async_quorum=False,  # a joining cell heals inside start_quorum and contributes in the same step
            timeout=timedelta(seconds=max(heal_timeout_s, collective_timeout_s)),
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_world_size,
            store_addr=store_host,
            store_port=store_port,
            lighthouse_addr=lighthouse_address,
            replica_id=f"cell_{cell}",
            hostname=host,
            checkpoint_transport=transport,
            init_sync=False,  # every cell initialises identical weights from model.init_seed
            max_retries=20,
        )
