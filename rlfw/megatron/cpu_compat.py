"""Make Megatron-core run on CPU (gloo) when CUDA is absent.

Megatron-core assumes CUDA in a handful of places. Each shim below names the call it works around; all are
applied at most once per process, and only when ``torch.cuda.is_available()`` is False, so the GPU path runs
Megatron untouched. Checked against megatron-core 0.16.1 (and 0.19.x, which also calls
``torch.cuda.current_stream`` in the grad-sync path).
"""

from __future__ import annotations

import importlib
import types

import torch

_APPLIED = False

# Modules that build tensors with a literal ``device="cuda"``: FP32Optimizer's ``_scale`` (optimizer.optimizer),
# ``total_num_tokens`` in the pipeline schedules, the grad-norm buffers and the grad-buffer warm-up tensor.
_CUDA_LITERAL_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",  # local_multi_tensor_l2_norm (the grad-norm fallback without Apex)
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")


class _CpuTorch(types.ModuleType):
    """A stand-in for the module-global ``torch`` that maps ``device="cuda"`` in tensor factories to CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name):
        if name == "cuda":
            return _CpuCuda()
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


class _CpuCuda:
    """``torch.cuda`` as seen by the shimmed modules: synchronising with a device that does not exist is a no-op."""

    def synchronize(self, *_args, **_kwargs) -> None:
        pass

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _NullStream:
    """What Megatron's grad sync waits on when there is no CUDA stream."""

    def wait_stream(self, _other) -> None:
        pass

    def synchronize(self) -> None:
        pass


def apply_cpu_compat() -> bool:
    """Install the CPU shims if CUDA is absent. Returns True when they are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    # DDP's _ParamAndGradBuffer, rotary embeddings and GlobalMemoryBuffer (DotProductAttention's scratch
    # space) allocate on torch.cuda.current_device(); a device string works wherever they pass it on.
    torch.cuda.current_device = lambda: "cpu"
    # 0.19.x start_grad_sync calls torch.cuda.current_stream(); there is only one "stream" on CPU.
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()

    for name in _CUDA_LITERAL_MODULES:
        module = importlib.import_module(name)
        module.torch = _CpuTorch()

    # clip_grad_by_total_norm_fp32 asserts ``grad.type() == "torch.cuda.FloatTensor"``; same scaling on CPU.
    from megatron.core.optimizer import optimizer as mcore_optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

    # Activation recompute (``model.recompute``) saves and restores the CUDA RNG state around each recomputed
    # forward; there is no CUDA generator, and the CPU one is saved beside it (torch.get_rng_state).
    # tests/megatron/test_recompute.py runs every recompute mode through this.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mcore_random._set_cuda_rng_state = lambda *a, **k: None

    # dist_checkpointing's file writer stages tensors to the host and then calls torch.cuda.synchronize(); CPU
    # tensors are already there.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.torch = _CpuTorch()

    _APPLIED = True
    return True
