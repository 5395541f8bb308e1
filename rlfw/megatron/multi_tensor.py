"""Megatron's multi-tensor optimizer helpers as torch's foreach kernels, where neither Apex nor Transformer Engine
brings them.

Why: without Apex or TE, megatron-core (0.16.1 to 0.19.2) falls back to per-tensor Python loops
(``megatron.core.utils.local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``). The gradient norm then takes
one norm kernel and one host sync per parameter (it builds a host tensor from a list of device scalars), and the
bf16 copy of the fp32 master weights after every step is, per parameter, a multiplication by 1.0 into an fp32
temporary and a copy. torch's foreach kernels do the same in a few multi-tensor launches, without the temporaries,
and leave one host sync (Megatron's own, for the clipping coefficient).

How Megatron reaches them: the module globals ``l2_norm_impl`` and ``multi_tensor_scale_impl`` of
``megatron.core.optimizer.clip_grads`` and ``multi_tensor_scale_impl`` of ``megatron.core.optimizer.optimizer``,
bound at import to Apex's or TE's kernels, else to the local fallbacks. They are private: ``install`` replaces only
the fallbacks, and ``tests/megatron/test_multi_tensor.py`` pins that Megatron's grad norm, clipping and master-weight
copy reach these functions and give the fallbacks' results.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]], per_tensor: bool,
            *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Apex's ``multi_tensor_l2norm``: the L2 norm of all tensors of ``tensor_lists[0]`` together, a one-element fp32
    tensor on their device (no host sync), and with ``per_tensor`` each tensor's norm."""
    tensors = tensor_lists[0]
    norms = torch.stack(torch._foreach_norm(tensors)).float()
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]], factor: float) -> None:
    """Apex's ``multi_tensor_scale``: ``dst = src * factor`` for each pair of ``tensor_lists`` (``[src, dst]``), cast
    to ``dst``'s dtype; Megatron copies the master weights with a factor of 1 and clips gradients in place."""
    src, dst = tensor_lists
    if factor == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def install() -> bool:
    """Put ``l2_norm`` and ``scale`` where megatron-core holds its local fallbacks; returns whether Megatron's
    optimizer now runs on foreach kernels or on Apex's or TE's own (anything else is left as it is)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    fallbacks = {(clip_grads, "l2_norm_impl"): (utils.local_multi_tensor_l2_norm, l2_norm),
                 (clip_grads, "multi_tensor_scale_impl"): (utils.local_multi_tensor_scale, scale),
                 (optimizer, "multi_tensor_scale_impl"): (utils.local_multi_tensor_scale, scale)}
    for (module, name), (local, ours) in fallbacks.items():
        if getattr(module, name, None) is local:
            setattr(module, name, ours)
    return all(getattr(module, name, None) is not local for (module, name), (local, _) in fallbacks.items())
