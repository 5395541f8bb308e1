"""Megatron's grad norm and clipping on torch's foreach kernels, where neither Apex nor Transformer Engine brings its
multi-tensor kernels.

Why: without Apex or TE, megatron-core (0.16.1 to 0.19.2) falls back to per-tensor Python loops
(``megatron.core.utils.local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``). The gradient norm then takes
one norm kernel and one host sync per parameter (it builds a host tensor from a list of device scalars), and
clipping multiplies each gradient into a temporary and copies it back. torch's foreach kernels do the same in a few
multi-tensor launches, in place, and leave one host sync (Megatron's own, for the clipping coefficient).

How Megatron reaches them: the module globals ``l2_norm_impl`` and ``multi_tensor_scale_impl`` of
``megatron.core.optimizer.clip_grads``, bound at import to Apex's or TE's kernels, else to the local fallbacks.
They are private: ``install`` replaces only the fallbacks, and ``tests/megatron/test_multi_tensor.py`` pins that
Megatron's optimizer step takes its grad norm from here. (The bf16 copy of the fp32 master weights does not use
them: under bf16 Megatron copies parameter by parameter, which is already one kernel each.)
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]], per_tensor: bool,
            *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Apex's ``multi_tensor_l2norm``: the L2 norm of all tensors of ``tensor_lists[0]`` together, a one-element fp32
    tensor on their device (no host sync), accumulated in fp32 whatever their dtype; with ``per_tensor`` also each
    tensor's norm."""
    tensors = tensor_lists[0]
    if not tensors:  # Megatron does not ask; Apex's kernel would answer on the flag's device
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else None
        return torch.zeros(1, device=device), (torch.zeros(0, device=device) if per_tensor else None)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]], factor: float) -> None:
    """Apex's ``multi_tensor_scale``: ``dst = src * factor`` for each pair of ``tensor_lists`` (``[src, dst]``), cast
    to ``dst``'s dtype; Megatron clips gradients with it in place."""
    src, dst = tensor_lists
    if not src:
        return
    if factor == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def install() -> bool:
    """Put ``l2_norm`` and ``scale`` where megatron-core holds its local fallbacks (Apex's or TE's kernels are left
    as they are); returns whether Megatron's grad norm and clipping now run on multi-tensor kernels."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    ours = {"l2_norm_impl": (utils.local_multi_tensor_l2_norm, l2_norm),
            "multi_tensor_scale_impl": (utils.local_multi_tensor_scale, scale)}
    for name, (local, replacement) in ours.items():
        if getattr(clip_grads, name) is local:
            setattr(clip_grads, name, replacement)
    return all(getattr(clip_grads, name) is not local for name, (local, _) in ours.items())
