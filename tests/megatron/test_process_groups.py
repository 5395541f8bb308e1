"""Megatron's model-parallel groups end a collective at the timeout the world asks for, not at Megatron's 30 minutes."""

import os
import time

import torch

import forked

TIMEOUT_S = 3.0


def _rank(rank: int, store_port: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlfw.cluster.store import connect_store
    from rlfw.megatron.cpu_compat import apply_cpu_compat
    from rlfw.megatron.process_groups import join_world

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    apply_cpu_compat()
    join_world(connect_store("127.0.0.1", store_port), rank, 2, torch.device("cpu"), tp=2, pp=1,
               timeout_s=60, groups_timeout_s=TIMEOUT_S)
    dist.barrier()
    if rank == 1:  # a stalled peer: never joins the tensor-parallel all-reduce
        time.sleep(3600)
        return
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=parallel_state.get_tensor_model_parallel_group())
        outcome = "returned"
    except RuntimeError as error:
        outcome = f"raised: {error}"
    torch.save({"outcome": outcome, "waited_s": time.monotonic() - started}, out)


def test_a_stalled_tensor_parallel_peer_is_an_error_after_the_collective_timeout(tmp_path):
    from rlfw.cluster.store import serve_store

    store = serve_store("127.0.0.1")
    out = str(tmp_path / "rank0.pt")
    spawn = forked.context()
    ranks = [spawn.Process(target=_rank, args=(rank, store.port, out), daemon=True) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        ranks[0].join(timeout=240)  # Megatron's default would hold it for 30 minutes
        assert ranks[0].exitcode == 0, "rank 0 did not finish: its all-reduce waited past the world's timeout"
        result = torch.load(out)
        assert result["outcome"].startswith("raised"), result
        assert result["waited_s"] >= TIMEOUT_S  # it waited for the peer, then gave up
    finally:
        for process in ranks:
            process.kill()
