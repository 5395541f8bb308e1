"""The trainer's optimizer state and gradient buffers off the device while a colocated engine generates.

With ``cluster.placement=colocated`` a trainer and an engine share a GPU, and most of the trainer's memory is state
it needs only inside a train call: Adam's two moments and, in bf16 runs, the fp32 master weights (12 bytes a
parameter), and DDP's fp32 gradient buffer (4 more). ``StateOffload.release`` copies the first to page-locked host
memory and frees their device storage; ``restore`` allocates it again and copies them back, bitwise. The storage is
freed and reallocated *in place* (``untyped_storage().resize_``), so every tensor and view that refers to it (the
optimizer's parameter groups and state, Megatron's ``main_grad`` views into the gradient buffer) is the same object
afterwards and nothing has to be re-wired. The gradient buffers are not copied: every train call zeroes them before
its first backward, so they come back zeroed. The model's own (bf16) weights stay: log-probs and weight exports
run between two train calls.

Megatron has ``offload_to_cpu`` on its optimizers and ``offload_grad_buffers`` on its DDP, but the former moves
through pageable memory and re-points ``param.data`` (0.16 and 0.19 differ in which objects they cover) and both
are CUDA-only; this one runs the same code on CPU, where CI exercises it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterator

import torch
from torch import Tensor


def optimizer_tensors(optimizer) -> list[Tensor]:
    """Every tensor of a Megatron optimizer's inner torch optimizers: parameters (fp32 masters, or the model's own
    in fp32 runs) and state (Adam's moments, its step counters)."""
    out = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = part.optimizer
        out += [p for group in inner.param_groups for p in group["params"]]
        out += [v for state in inner.state.values() for v in state.values() if isinstance(v, Tensor)]
    return out


class StateOffload:
    """Moves the device storage of the tensors ``collect()`` names out and back: ``(keep, drop, shared)``, where
    ``keep`` are copied to the host and back, ``drop`` come back zeroed, and a storage that a ``shared`` tensor also
    holds (the model's weights) stays. Thread-safe; ``release`` and ``restore`` are idempotent."""

    def __init__(self, device: torch.device,
                 collect: Callable[[], tuple[list[Tensor], list[Tensor], list[Tensor]]]) -> None:
        self.device, self.collect = device, collect
        self._lock = threading.RLock()
        self._out: list[tuple[torch.UntypedStorage, int, Tensor | None]] = []  # storage, bytes, host copy
        self._host: dict[int, Tensor] = {}  # page-locked buffers, reused from one release to the next
        self.last: dict[str, float] = {}  # what the last release and restore moved and took

    @property
    def released(self) -> bool:
        return bool(self._out)

    def release(self) -> None:
        with self._lock:
            if self._out:
                return
            started = time.perf_counter()
            keep, drop, shared = self.collect()
            stay = {t.untyped_storage().data_ptr() for t in shared}
            seen: set[int] = set()
            copied = 0
            for tensors, copy in ((keep, True), (drop, False)):
                for t in tensors:
                    storage = t.untyped_storage()
                    ptr, size = storage.data_ptr(), storage.nbytes()
                    if t.device != self.device or size == 0 or ptr in stay or ptr in seen:
                        continue
                    seen.add(ptr)
                    host = None
                    if copy:
                        host = self._host_buffer(len(self._out), size)
                        host.copy_(_bytes(storage, t.device), non_blocking=True)
                        copied += size
                    self._out.append((storage, size, host))
            self._synchronize()  # the copies are done before the storage goes
            for storage, _, _ in self._out:
                storage.resize_(0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.last = {"release_s": time.perf_counter() - started,
                         "released_gib": sum(size for _, size, _ in self._out) / 2**30, "copied_gib": copied / 2**30}

    def restore(self) -> None:
        with self._lock:
            if not self._out:
                return
            started = time.perf_counter()
            for storage, size, host in self._out:
                storage.resize_(size)
                target = _bytes(storage, self.device)
                if host is None:
                    target.zero_()
                else:
                    target.copy_(host, non_blocking=True)
            self._synchronize()
            self._out = []
            self.last["restore_s"] = time.perf_counter() - started

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The state on the device for the block; released again after it if it was released before."""
        with self._lock:
            was_released = self.released
            self.restore()
            try:
                yield
            finally:
                if was_released:
                    self.release()

    def _host_buffer(self, index: int, size: int) -> Tensor:
        buffer = self._host.get(index)
        if buffer is None or buffer.numel() != size:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._host[index] = buffer
        return buffer

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def trainer_offload(trainer) -> StateOffload:
    """The ``StateOffload`` of a ``PolicyTrainer`` or ``ValueTrainer``: its optimizer's tensors kept, its DDP
    gradient buffers dropped, its model's weights staying."""
    return StateOffload(trainer.device, lambda: (optimizer_tensors(trainer.optimizer), trainer.grad_buffers(),
                                                 list(trainer.model.parameters())))


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
