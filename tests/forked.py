"""The tests' child processes as forks of a server that has imported torch, torchft and Megatron once.

A spawned child imports them again (4-9 CPU-seconds each on these two cores, where the suite starts dozens of cell
and rank processes); multiprocessing's forkserver starts its server once per test process, with ``PRELOAD``
imported, and forks every child from it. A child is still a process of its own, single-threaded at its start and
sharing nothing with the test process, so a SIGKILL or SIGSTOP hits that child alone, as in a spawned one.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

# What the cell harness, the host-shared members and the Megatron worlds import; the first user starts the server.
PRELOAD = ["torch", "torchft", "rlfw.ft.cell_sync", "rlfw.train_group.minibatches", "rlfw.megatron.policy"]


def context() -> BaseContext:
    """multiprocessing's forkserver context, its server importing ``PRELOAD`` when it starts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_processes(entry, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(entry, args, nprocs, join=True)``, its ranks forked from the server:
    ``entry(rank, *args)`` in each, an error in one raised here."""
    import torch.multiprocessing

    context()  # the server's preload, if this starts it
    torch.multiprocessing.start_processes(entry, args=args, nprocs=nprocs, join=True, start_method="forkserver")
