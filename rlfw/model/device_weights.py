"""Weights handed to an engine on the same GPU without a trip through host memory: one device buffer and a CUDA IPC
handle to it.

The writer packs its HF-named state dict into one contiguous device buffer (one copy, device to device) and shares
that buffer's CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``: what torch's own queues send for
a CUDA tensor) with the layout. An engine process on the same GPU opens the handle, views each weight in the buffer
and loads them into its own tensors (``LocalEngine.update_weights``: a device-to-device copy). One handle instead of
one per tensor: opening a handle costs the receiver a driver call, and a model has hundreds of tensors. The writer
keeps the buffer alive until every engine has loaded it (the next ``pack`` replaces it).

In the loop (``rollout.weight_transport=device``): the writer's leader packs after each committed step and returns
a ``SharedWeights`` (the handle and the layout, a few kilobytes) where the host path returns the weights
themselves, so the rollout manager and Ray pass on a handle, and each engine copies the weights device to device.
The handle is valid while the writer's process lives: an engine restarted after its writer died cannot open it, and
says so (``rollout.weight_transport=host`` keeps a host copy that such an engine can load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.multiprocessing.reductions import reduce_tensor

ALIGN = 256  # bytes; every tensor starts at an address its dtype (and vectorised copies) can read


@dataclass
class PackedWeights:
    buffer: Tensor  # uint8, on the device
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]  # name, dtype, shape, byte offset

    def tensors(self) -> dict[str, Tensor]:
        """Views of every weight in the buffer (no copy)."""
        out = {}
        for name, dtype, shape, offset in self.layout:
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            out[name] = self.buffer[offset:offset + nbytes].view(dtype).view(shape)
        return out

    def share(self) -> "SharedWeights":
        """What another process on the same GPU needs to open the buffer (picklable: a Ray or queue message)."""
        return SharedWeights(reduce_tensor(self.buffer), self.layout)


@dataclass(frozen=True)
class SharedWeights:
    """A packed buffer as another process on the same GPU opens it: its CUDA IPC handle and its layout."""

    handle: tuple  # (rebuild function, its arguments): torch.multiprocessing.reductions.reduce_tensor's answer
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]

    def open(self) -> PackedWeights:
        """The sharer's buffer, mapped into this process (no copy); valid while the sharer keeps it."""
        rebuild, args = self.handle
        return PackedWeights(rebuild(*args), self.layout)


def pack(state: dict[str, Tensor]) -> PackedWeights:
    """One device buffer holding every tensor of ``state`` (all on one device)."""
    layout, offset = [], 0
    for name, t in state.items():
        layout.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    device = next(iter(state.values())).device
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    packed = PackedWeights(buffer, layout)
    for (name, _, _, _), view in zip(layout, packed.tensors().values()):
        view.copy_(state[name])
    return packed


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
