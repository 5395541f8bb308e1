"""The cross-cell all-reduce through shared memory, for the cells of a quorum that share one host.

Cells on one host (CPU cells, or cells sharing one GPU, which NCCL cannot join) meet over torchft's Gloo group,
whose all-reduce runs a TCP ring over the loopback device: every byte is copied through the kernel's socket
buffers several times. Here each member copies its tensor once into a shared-memory segment of its own, meets the
others at one store barrier, and sums every member's segment in rank order, so every cell gets the same bits.
Everything else the group does (heals' send/recv, broadcasts) stays Gloo's. docs/ARCHITECTURE.md says why a device
path (CUDA IPC between the cells' buffers) is not used.

Per all-reduce ``n`` of a quorum (members issue the same all-reduces in the same order, as for any collective):

1. write: copy the tensor into this member's segment for its byte size, created at first use and reserved with
   ``posix_fallocate``, so a full /dev/shm is an error here and not a SIGBUS later;
2. arrive: set ``arrive/n/<rank>`` to what this member offers (``shm <dtype> <numel> <op>``, or ``gloo <why>``),
   and wait for every member's key. The wait is bounded by the group's timeout, and a member whose process is gone
   fails it at once;
3. sum, if every member offered ``shm``; otherwise all of them run this all-reduce over Gloo, decided from the same
   keys, so the same everywhere (a short /dev/shm falls back, and says why, in the log);
4. done: set ``done/n/<rank>``. A segment is written again only once every member has finished reading it: an
   arrival at the next all-reduce proves that, and for back-to-back uses of one segment the ``done`` keys do.

After a segment's first use every member has mapped it, so its owner unlinks the name: the mappings stay valid,
and the kernel frees the memory when the last one goes, a SIGKILLed member's included. A member killed before that
leaves a file named by its pid, which the next configure on the host removes.

Errors raise out of ``allreduce``; torchft's Manager turns them into ``report_error``, so the step is not
committed, exactly as for a failed Gloo all-reduce. torchft reconfigures the group (a new quorum id, new segments)
after a failed commit.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import psutil
import torch
from torch.distributed import AllreduceOptions, ReduceOp

from rlfw.ft.torchft_api import ReconfigurableGloo, create_store_client

logger = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"
DEVICE_CHUNK_BYTES = 64 << 20  # device tensors are summed on the device through a scratch buffer of this size
_PREFIX = "rlfw-shm"
_NAME = re.compile(rf"^{_PREFIX}-(\d+)-(\d+)-")  # pid namespace, pid
_REDUCE = {
    "SUM": lambda a, b, out: torch.add(a, b, out=out),
    "MIN": lambda a, b, out: torch.minimum(a, b, out=out),
    "MAX": lambda a, b, out: torch.maximum(a, b, out=out),
}


def _op_name(op) -> str:
    """``SUM``/``MIN``/``MAX`` for those reduce ops (a ReduceOp or its RedOpType), else what the op prints as."""
    return next((name for name in _REDUCE if op == getattr(ReduceOp, name)), str(op))


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def host_key(root: str) -> str:
    """What members must share to meet through ``root``: the running kernel, the very filesystem behind it (two
    containers on one machine usually have /dev/shm mounts of their own), and the network namespace, which is
    where rlfw draws a node's boundary (the multi-node tests run their nodes as namespaces of one machine)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    st = os.stat(root)
    return f"{boot}:{st.st_dev}:{st.st_ino}:{os.stat('/proc/self/ns/net').st_ino}"


def process_alive(pid: int) -> bool:
    """Whether ``pid`` (in this pid namespace) still runs; a zombie has died."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def remove_orphans(root: str) -> List[str]:
    """Unlink the segments whose owner (a process of this pid namespace) is dead: those of a member killed before
    its segments' first use was over."""
    removed, ns = [], _pid_namespace()
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and int(m.group(1)) == ns and not process_alive(int(m.group(2))):
            try:
                os.unlink(os.path.join(root, name))
                removed.append(name)
            except FileNotFoundError:
                pass  # another member removed it first
    return removed


class _Completed(torch.distributed.Work):
    """The Work of an all-reduce that finished before ``allreduce`` returned."""

    def __init__(self, tensors: List[torch.Tensor]):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(tensors)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class PeerLostError(RuntimeError):
    """A member of the all-reduce died or stayed away past the group's timeout."""


class _Segment:
    """One member's shared-memory buffer of a given byte size, mapped in this process."""

    def __init__(self, path: str, nbytes: int, create: bool):
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError:
                    os.unlink(path)
                    raise
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.path, self.bytes = path, torch.frombuffer(self.mm, dtype=torch.uint8)
        self.last_use, self.uses = -1, 0  # this member's own segment: the all-reduce that last wrote it, how often
        self.page_locked = False

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.bytes.view(dtype)[:numel]

    def page_lock(self) -> None:
        """Register the mapping with CUDA, so copies to and from the device run at the bus's rate instead of through
        the driver's bounce buffers. Only this process's mapping is registered: a peer's death does not touch it.
        Where the driver refuses, copies stay pageable (slower, still correct)."""
        if not self.page_locked:
            err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.bytes.numel(), 0)
            self.page_locked = int(err) == 0

    def close(self) -> None:
        if self.page_locked:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # a view still referenced somewhere: the mapping goes with it
            pass


class ProcessGroupHostShared(ReconfigurableGloo):
    """torchft's reconfigurable Gloo group whose all-reduce goes through shared memory when every member of the
    quorum is on this host (module docstring); the other collectives are Gloo's."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), root: str = SHM_ROOT):
        super().__init__(timeout=timeout)
        self.root = root
        self.fallback_reason: Optional[str] = None  # why this quorum's all-reduces go over Gloo; None: they don't
        self.shared_allreduces = 0  # all-reduces summed through shared memory, over the group's life
        self._store = None
        self._rank = 0
        self._size = 1
        self._ns = 0
        self._members: List[Tuple[int, int]] = []  # each member's (pid namespace, pid): its liveness and file names
        self._tag = ""
        self._seq = 0
        self._said: set = set()  # the fallback reasons logged in this quorum
        self._own: Dict[int, _Segment] = {}
        self._theirs: Dict[Tuple[int, int], _Segment] = {}
        self._staging: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def getBackendName(self) -> str:
        return "rlfw-host-shared"

    # --------------------------------------------------------------------------------------------- set-up
    def _before_configure(self) -> None:
        self._close_segments()

    def _configured(self, store_addr: str, rank: int, world_size: int) -> None:
        self._rank, self._size, self._seq, self._said = rank, world_size, 0, set()
        self._tag = hashlib.sha1(store_addr.encode()).hexdigest()[:12]  # unique per job, quorum and group rank
        self._store = create_store_client(f"{store_addr}/rlfw_shm", timeout=self._timeout)
        self._ns = ns = _pid_namespace()
        try:
            mine = host_key(self.root)
        except OSError as e:
            mine = f"unusable: {e}"
        self._store.set(f"host/{rank}", f"{mine}|{ns}|{os.getpid()}")
        members = [self._store.get(f"host/{r}").decode().split("|") for r in range(world_size)]
        self._members = [(int(their_ns), int(pid)) for _, their_ns, pid in members]
        if mine.startswith("unusable"):
            self.fallback_reason = f"{self.root} is {mine}"
        elif any(key != mine for key, _, _ in members):
            self.fallback_reason = (f"the quorum's members do not share {self.root} "
                                    "(other hosts, containers or network namespaces)")
        else:
            self.fallback_reason = None
            remove_orphans(self.root)
        if self.fallback_reason and world_size > 1:
            logger.warning("cross-cell all-reduce over Gloo: %s", self.fallback_reason)

    def abort(self, errored: bool = True) -> None:
        self._close_segments()
        super().abort(errored)

    def shutdown(self) -> None:
        self._close_segments()
        super().shutdown()

    def _close_segments(self) -> None:
        for seg in self._own.values():
            try:
                os.unlink(seg.path)
            except FileNotFoundError:
                pass  # unlinked after its first use, as usual
        for seg in [*self._own.values(), *self._theirs.values()]:
            seg.close()
        self._own, self._theirs = {}, {}

    # ------------------------------------------------------------------------------------------- all-reduce
    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> torch.distributed.Work:
        op = opts.reduceOp if isinstance(opts, AllreduceOptions) else opts
        if self._size == 1 or self.fallback_reason is not None:
            return super().allreduce(tensors, opts)
        n, self._seq = self._seq, self._seq + 1
        try:
            offer = self._write(tensors, op, n)
            self._store.set(f"arrive/{n}/{self._rank}", offer)
            self._wait([f"arrive/{n}/{r}" for r in range(self._size)], n, f"all-reduce {n}")
            offers = [self._store.get(f"arrive/{n}/{r}").decode() for r in range(self._size)]
            gloo = [o[5:] for o in offers if o.startswith("gloo")]
            if not gloo and len(set(offers)) != 1:
                raise RuntimeError(f"all-reduce {n}: the members disagree on what they reduce: {offers}")
            if not gloo:
                self._reduce(tensors[0], offers[0].rsplit(" ", 1)[1])
                self.shared_allreduces += 1
            self._store.set(f"done/{n}/{self._rank}", "1")
            if not gloo:
                self._unlink_after_first_use(tensors[0], n)
            self._forget(n - 2)
        except Exception as e:
            with contextlib.suppress(RuntimeError):  # the store itself may be what failed
                self._store.set(f"abort/{n}", f"member {self._rank}: {e}")  # its peers stop waiting for it at once
            raise
        if gloo:
            reason = gloo[0].split(" (")[0]  # without the free bytes, which vary
            if reason not in self._said:  # once per reason and quorum, not at every step
                self._said.add(reason)
                logger.warning("cross-cell all-reduce %d over Gloo: %s", n, gloo[0])
            return super().allreduce(tensors, opts)
        return _Completed(tensors)

    def _write(self, tensors: List[torch.Tensor], op, n: int) -> str:
        """Copy the tensor into this member's segment; return the offer, ``gloo <why>`` where that cannot be."""
        name = _op_name(op)
        if len(tensors) != 1 or name not in _REDUCE:
            return f"gloo {len(tensors)} tensors, op {name}"
        t = tensors[0]
        if not t.is_contiguous():
            return "gloo a non-contiguous tensor"
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return f"shm {t.dtype} 0 {name}"
        seg = self._own.get(nbytes)
        if seg is None:
            try:
                seg = self._own[nbytes] = _Segment(self._path(self._rank, nbytes), nbytes, create=True)
            except OSError as e:
                free = os.statvfs(self.root)
                return f"gloo {self.root} cannot hold {nbytes} bytes ({free.f_bavail * free.f_frsize} free): {e}"
        elif seg.last_use == n - 1:  # back to back: wait until every member has read the previous one
            self._wait([f"done/{n - 1}/{r}" for r in range(self._size)], n, f"all-reduce {n - 1}'s readers")
        if t.device.type == "cuda":
            seg.page_lock()
        seg.view(t.dtype, t.numel()).copy_(t.reshape(-1))
        seg.last_use, seg.uses = n, seg.uses + 1
        return f"shm {t.dtype} {t.numel()} {name}"

    def _reduce(self, t: torch.Tensor, op: str) -> None:
        """Every member's contribution, combined in rank order: the same bits in every member."""
        if t.numel() == 0:
            return
        nbytes = t.numel() * t.element_size()
        segments = [self._segment(r, nbytes) for r in range(self._size)]
        parts = [seg.view(t.dtype, t.numel()) for seg in segments]
        if t.device.type == "cuda":
            for seg in segments:
                seg.page_lock()
            return self._reduce_on_device(t.view(-1), parts, op)
        out = t.view(-1)
        _REDUCE[op](parts[0], parts[1], out)
        for part in parts[2:]:
            _REDUCE[op](out, part, out)

    def _reduce_on_device(self, t: torch.Tensor, parts: List[torch.Tensor], op: str) -> None:
        """Device tensors are combined on their device: each part goes up in chunks through one scratch buffer
        (the host has one thread per cell for a sum; the device has bandwidth to spare), in rank order into ``t``.
        Member 0's own part is ``t`` already; the others start from part 0."""
        scratch = self._scratch(t)
        for lo in range(0, t.numel(), scratch.numel()):
            hi = min(lo + scratch.numel(), t.numel())
            acc, buf = t[lo:hi], scratch[: hi - lo]
            if self._rank != 0:
                acc.copy_(parts[0][lo:hi])
            for part in parts[1:]:
                buf.copy_(part[lo:hi])
                _REDUCE[op](acc, buf, acc)
        torch.cuda.current_stream(t.device).synchronize()  # the segments are rewritten once this returns

    def _unlink_after_first_use(self, t: torch.Tensor, n: int) -> None:
        """Once every member has read this member's new segment, all of them hold a mapping: the name can go."""
        seg = self._own.get(t.numel() * t.element_size())
        if seg is not None and seg.uses == 1 and seg.last_use == n:
            self._wait([f"done/{n}/{r}" for r in range(self._size)], n, f"all-reduce {n}'s readers")
            os.unlink(seg.path)

    def _path(self, rank: int, nbytes: int) -> str:
        ns, pid = self._members[rank]
        return os.path.join(self.root, f"{_PREFIX}-{ns}-{pid}-{self._tag}-r{rank}-b{nbytes}")

    def _segment(self, rank: int, nbytes: int) -> _Segment:
        if rank == self._rank:
            return self._own[nbytes]
        if (rank, nbytes) not in self._theirs:
            try:
                self._theirs[(rank, nbytes)] = _Segment(self._path(rank, nbytes), nbytes, create=False)
            except FileNotFoundError as e:
                raise PeerLostError(f"member {rank}'s segment of {nbytes} bytes is gone (it failed or left): {e}")
        return self._theirs[(rank, nbytes)]

    def _scratch(self, t: torch.Tensor) -> torch.Tensor:
        """The device buffer parts go up through: at most DEVICE_CHUNK_BYTES, not a second gradient buffer."""
        numel = max(1, min(t.numel(), DEVICE_CHUNK_BYTES // t.element_size()))
        key = (t.device, t.dtype)
        if key not in self._staging or self._staging[key].numel() < numel:
            self._staging[key] = torch.empty(numel, dtype=t.dtype, device=t.device)
        return self._staging[key]

    def _forget(self, n: int) -> None:
        """Delete this member's keys of all-reduce ``n``: every member has arrived at ``n + 2``, past all use."""
        if n >= 0:
            self._store.delete_key(f"arrive/{n}/{self._rank}")
            self._store.delete_key(f"done/{n}/{self._rank}")

    def _wait(self, keys: List[str], n: int, what: str) -> None:
        """Wait for ``keys`` in all-reduce ``n``, polling (a store wait logs a warning at every timeout), at most the
        group's timeout. A member whose process has died, or that gave up on all-reduce n or the one before (the
        furthest a member can be behind another), fails the wait at once."""
        aborts = [f"abort/{k}" for k in (n - 1, n) if k >= 0]
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause, last_look = 5e-5, time.monotonic()
        while not self._store.check(keys):
            now = time.monotonic()
            if now - last_look > 0.1:
                last_look = now
                dead = [r for r, (ns, pid) in enumerate(self._members) if ns == self._ns and not process_alive(pid)]
                if dead:
                    raise PeerLostError(f"{what}: member(s) {dead} died (pids {[self._members[r][1] for r in dead]})")
                for key in aborts:
                    if self._store.check([key]):
                        raise PeerLostError(f"{what}: {self._store.get(key).decode()}")
            if now > deadline:
                missing = [k for k in keys if not self._store.check([k])]
                raise PeerLostError(f"{what}: no word from {missing} in {self._timeout.total_seconds():g} s "
                                    "(ft.collective_timeout_s): a member stalled or its host is cut off")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
