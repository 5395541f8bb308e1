"""The shared-memory cross-cell all-reduce (rlfw/ft/host_shared.py), between real processes.

Each member is a spawned process with its own ProcessGroupHostShared, configured through a real TCPStore the way
torchft's Manager configures it; peers die by SIGKILL and stall by SIGSTOP.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import AllreduceOptions, ReduceOp, TCPStore

import forked
from rlfw.ft.host_shared import (DEVICE_CHUNK_BYTES, SHM_ROOT, PeerLostError, ProcessGroupHostShared, process_alive,
                                 remove_orphans)

REPLY_TIMEOUT_S = 120.0  # spawn + torch/torchft import of three processes on two loaded cores


def contributions(rank: int):
    """What member ``rank`` all-reduces, in order: (tensor, op). Sizes repeat back to back and after a gap, so a
    segment is rewritten both ways; one is empty; bf16 and int64 take their own paths."""
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(100_003, generator=g), ReduceOp.SUM),
        (torch.randn(100_003, generator=g), ReduceOp.SUM),  # same segment, back to back
        (torch.randn(7, 5, generator=g).to(torch.bfloat16), ReduceOp.SUM),
        (torch.randint(-50, 50, (33,), generator=g), ReduceOp.MIN),
        (torch.randint(-50, 50, (33,), generator=g), ReduceOp.MAX),
        (torch.empty(0), ReduceOp.SUM),
        (torch.randn(100_003, generator=g), ReduceOp.SUM),  # same segment after others
    ]


def expected(world: int):
    """The rank-order reduction every member must return, bit for bit."""
    per_rank = [contributions(r) for r in range(world)]
    out = []
    for i, (t, op) in enumerate(per_rank[0]):
        acc = t.clone()
        for r in range(1, world):
            other = per_rank[r][i][0]
            acc = {ReduceOp.SUM: torch.add, ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}[op](acc, other)
        out.append(acc)
    return out


def allreduce(pg, t, op):
    opts = AllreduceOptions()
    opts.reduceOp = op
    pg.allreduce([t], opts).wait()
    return t


def by_value(tensors):
    """Tensors as (dtype, shape, bytes), which a pipe carries by value: a tensor goes as a file descriptor that the
    receiver fetches from the sender, which may have exited by then (``ConnectionResetError``)."""
    return [(t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for t in tensors]


def member(rank, world, port, root, quorum, plan, conn):
    """One member: configure like torchft's Manager does, then follow ``plan``, replying over ``conn``."""
    try:
        pg = ProcessGroupHostShared(timeout=timedelta(seconds=plan.get("timeout_s", 60)), root=root)
        pg.configure(f"127.0.0.1:{port}/torchft/{quorum}/0", f"cell_{rank}", rank, world, quorum_id=quorum)
        if plan["kind"] == "contributions":
            device = plan.get("device", "cpu")
            results = [allreduce(pg, t.to(device), op).cpu() for t, op in contributions(rank)]
            leftovers = sorted(f for f in os.listdir(root) if f.startswith("rlfw-shm"))
            conn.send(("ok", by_value(results), pg.shared_allreduces, pg.fallback_reason, leftovers))
        elif plan["kind"] == "sizes":
            said = []
            handler = logging.Handler()
            handler.emit = lambda record: said.append(record.getMessage())
            logging.getLogger("rlfw.ft.host_shared").addHandler(handler)
            results = [allreduce(pg, torch.full((n,), float(rank + 1)), ReduceOp.SUM) for n in plan["sizes"]]
            conn.send(("ok", by_value(results), pg.shared_allreduces, pg.fallback_reason, said))
        elif plan["kind"] == "ramp":  # one tensor larger than the device path's chunk
            t = torch.arange(plan["numel"], dtype=torch.float32, device=plan["device"]) + rank
            conn.send(("ok", by_value([allreduce(pg, t, ReduceOp.SUM).cpu()]), pg.shared_allreduces, pg.fallback_reason, None))
        elif plan["kind"] == "one_then_wait":  # one all-reduce, then the test stops or kills this member
            allreduce(pg, torch.ones(1000), ReduceOp.SUM)
            conn.send(("ready",))
            if rank == 0:
                conn.recv()
                try:
                    allreduce(pg, torch.ones(1000), ReduceOp.SUM)
                    conn.send(("ok",))
                except PeerLostError as e:
                    conn.send(("lost", str(e)))
            else:
                time.sleep(600)
        elif plan["kind"] == "abort":  # member 1 loses member 0's segment (removed from outside) and gives up
            t = torch.ones(5000)
            if rank == 1:
                conn.recv()
            try:
                allreduce(pg, t, ReduceOp.SUM)
                conn.send(("ok",))
            except (PeerLostError, OSError) as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
            conn.recv()  # keep this member's own segment until its peer has answered
        elif plan["kind"] == "numel":
            try:
                allreduce(pg, torch.ones(10 + rank), ReduceOp.SUM)
                conn.send(("ok",))
            except RuntimeError as e:
                conn.send(("error", str(e)))
        pg.shutdown()
    except BaseException as e:  # noqa: BLE001 - the test reads it
        conn.send(("crash", repr(e)))
        raise


class Members:
    def __init__(self, world, roots, plans, quorum=1):
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        ctx = forked.context()
        self.procs, self.conns = [], []
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            args = (rank, world, self.store.port, roots[rank], quorum, plans[rank], theirs)
            p = ctx.Process(target=member, args=args, daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(mine)

    def reply(self, rank, timeout_s=REPLY_TIMEOUT_S):
        if not self.conns[rank].poll(timeout_s):
            raise AssertionError(f"member {rank} sent nothing in {timeout_s} s")
        reply = self.conns[rank].recv()
        if reply[0] == "ok" and len(reply) > 1 and isinstance(reply[1], list):
            tensors = [torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else
                       torch.empty(shape, dtype=dtype) for dtype, shape, data in reply[1]]
            reply = (reply[0], tensors, *reply[2:])
        return reply

    def close(self):
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(10)


@pytest.fixture
def shm_root(tmp_path):
    """A fresh directory on /dev/shm, so tests neither see nor touch anything else's segments."""
    root = os.path.join(SHM_ROOT, f"rlfw-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(root)
    yield root
    for f in os.listdir(root):
        os.unlink(os.path.join(root, f))
    os.rmdir(root)


def test_every_member_gets_the_rank_order_reduction_bitwise_and_no_segment_outlives_its_first_use(shm_root):
    world = 3
    members = Members(world, [shm_root] * world, [{"kind": "contributions"}] * world)
    try:
        replies = [members.reply(r) for r in range(world)]
    finally:
        members.close()
    want = expected(world)
    for rank, (status, results, shared, reason, leftovers) in enumerate(replies):
        assert status == "ok", replies[rank]
        assert reason is None
        assert shared == len(want)  # every one went through shared memory, not Gloo
        assert leftovers == []  # names unlinked once mapped by all; the memory goes with the last mapping
        for got, ref in zip(results, want):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(got.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8)), f"member {rank}"
    assert os.listdir(shm_root) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (cells sharing one GPU)")
def test_cells_sharing_a_gpu_get_the_rank_order_reduction_of_their_device_tensors_bitwise(shm_root):
    """Device tensors go down into the segments and the sum (on the host, in rank order) comes back up."""
    members = Members(2, [shm_root] * 2, [{"kind": "contributions", "device": "cuda"}] * 2)
    try:
        replies = [members.reply(r) for r in range(2)]
    finally:
        members.close()
    want = expected(2)
    for status, results, shared, reason, _ in replies:
        assert status == "ok" and reason is None and shared == len(want)
        for got, ref in zip(results, want):
            assert torch.equal(got.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (cells sharing one GPU)")
def test_a_device_tensor_of_several_chunks_is_reduced_whole(shm_root):
    numel = 3 * DEVICE_CHUNK_BYTES // 4 + 12_345  # three chunks and a remainder
    members = Members(2, [shm_root] * 2, [{"kind": "ramp", "numel": numel, "device": "cuda"}] * 2)
    try:
        replies = [members.reply(r) for r in range(2)]
    finally:
        members.close()
    ramp = torch.arange(numel, dtype=torch.float32)
    want = ramp + (ramp + 1)
    for status, [got], shared, _, _ in replies:
        assert status == "ok" and shared == 1 and torch.equal(got, want)


def test_members_that_do_not_share_the_filesystem_all_fall_back_to_gloo_and_say_why(shm_root, tmp_path):
    world = 2
    members = Members(world, [shm_root, str(tmp_path)], [{"kind": "contributions"}] * world)
    try:
        replies = [members.reply(r) for r in range(world)]
    finally:
        members.close()
    for status, results, shared, reason, _ in replies:
        assert status == "ok"
        assert shared == 0 and "do not share" in reason
        for got, ref in zip(results, expected(world)):
            torch.testing.assert_close(got, ref)  # Gloo sums in its own order: equal, not bitwise


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_segment_the_filesystem_cannot_hold_sends_that_all_reduce_over_gloo_for_every_member(tmp_path):
    root = str(tmp_path / "small")
    os.makedirs(root)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", root], check=True)
    try:
        sizes = [1000, 400_000, 400_000, 1000]  # 4 KB fits; 1.6 MB per member does not
        members = Members(2, [root, root], [{"kind": "sizes", "sizes": sizes}] * 2)
        try:
            replies = [members.reply(r) for r in range(2)]
        finally:
            members.close()
    finally:
        subprocess.run(["umount", root], check=True)
    for status, results, shared, reason, said in replies:
        assert status == "ok" and reason is None
        assert shared == 2  # the two small ones; the big ones went over Gloo, decided alike by both members
        assert [r.tolist() for r in results] == [[3.0] * n for n in sizes]
        [warning] = said  # once, not at every all-reduce that falls back
        assert "over Gloo" in warning and "cannot hold 1600000 bytes" in warning


def signal_peer_then_all_reduce(shm_root, sig, timeout_s):
    """Two members all-reduce once; member 1 gets ``sig``; member 0's next all-reduce answers (status, message)."""
    members = Members(2, [shm_root] * 2, [{"kind": "one_then_wait", "timeout_s": timeout_s}] * 2)
    try:
        assert [members.reply(r)[0] for r in range(2)] == ["ready", "ready"]
        os.kill(members.procs[1].pid, sig)
        if sig == signal.SIGKILL:
            members.procs[1].join(10)
        members.conns[0].send("go")
        return members.reply(0, timeout_s=120)
    finally:
        members.close()


def test_a_peer_killed_mid_run_fails_the_next_all_reduce_at_once_naming_it(shm_root):
    # far below the 600 s timeout: the pid is seen dead
    status, message = signal_peer_then_all_reduce(shm_root, signal.SIGKILL, timeout_s=600)
    assert status == "lost" and "died" in message and "[1]" in message


def test_a_stopped_peer_fails_the_all_reduce_at_the_group_timeout_naming_its_key(shm_root):
    status, message = signal_peer_then_all_reduce(shm_root, signal.SIGSTOP, timeout_s=3)
    assert status == "lost" and "no word from" in message and "arrive/1/1" in message


def test_members_reducing_different_tensors_both_refuse(shm_root):
    members = Members(2, [shm_root] * 2, [{"kind": "numel", "timeout_s": 60}] * 2)
    try:
        replies = [members.reply(r) for r in range(2)]
    finally:
        members.close()
    for status, message in replies:
        assert status == "error" and "disagree" in message


def test_a_member_that_fails_mid_all_reduce_stops_its_peers_at_once(shm_root):
    """Member 1 cannot open member 0's segment; its abort key, not the 600 s timeout, releases member 0, which was
    waiting for member 1 to finish reading."""
    members = Members(2, [shm_root] * 2, [{"kind": "abort", "timeout_s": 600}] * 2)
    try:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not [f for f in os.listdir(shm_root) if f.endswith("-r0-b20000")] and time.monotonic() < deadline:
            time.sleep(0.05)  # member 0 has written its part and waits for member 1
        [segment] = [f for f in os.listdir(shm_root) if f.endswith("-r0-b20000")]
        os.unlink(os.path.join(shm_root, segment))
        members.conns[1].send("go")
        replies = [members.reply(r, timeout_s=120) for r in range(2)]
        for conn in members.conns:
            conn.send("end")
    finally:
        members.close()
    assert replies[1][0] == "error" and "segment" in replies[1][1] and "is gone" in replies[1][1]
    assert replies[0][0] == "error" and "PeerLostError" in replies[0][1] and "member 1" in replies[0][1]


def _host_key_in(netns):
    code = "from rlfw.ft.host_shared import host_key; print(host_key('/dev/shm'))"
    prefix = ["ip", "netns", "exec", netns] if netns else []
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return out.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and ip")
def test_a_process_in_another_network_namespace_is_another_node():
    """The multi-node tests run nodes as network namespaces of one machine: cells there must meet over Gloo."""
    netns = f"rlfwhostkey{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        here, again, there = _host_key_in(None), _host_key_in(None), _host_key_in(netns)
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=True)
    assert here == again != there


def _create_and_hang(root, name):
    with open(os.path.join(root, name.format(pid=os.getpid())), "w"):
        pass
    time.sleep(600)


def test_orphans_of_dead_processes_are_removed_and_live_ones_kept(shm_root):
    ns = os.stat("/proc/self/ns/pid").st_ino
    ctx = forked.context()
    name = f"rlfw-shm-{ns}-{{pid}}-abc-r0-b8"
    dead, live = (ctx.Process(target=_create_and_hang, args=(shm_root, name), daemon=True) for _ in range(2))
    dead.start()
    live.start()
    try:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while len(os.listdir(shm_root)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(10)
        assert not process_alive(dead.pid) and process_alive(live.pid)
        assert remove_orphans(shm_root) == [name.format(pid=dead.pid)]
        assert os.listdir(shm_root) == [name.format(pid=live.pid)]
    finally:
        live.kill()
        live.join(10)
