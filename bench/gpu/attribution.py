"""Where a step's device time goes: torch.profiler's kernel times, grouped by what the kernels do.

The gap between the wall time and the device-busy time is time the GPU waited for the host (launches, syncs, host
work); the groups split the busy time into matmuls, attention, the optimizer, copies and the element-wise rest.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

GROUPS = (  # first match wins (flash attention's kernels name cutlass types); kernel names are lower-cased
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "l2norm", "normops")),
    ("nccl", ("nccl",)),
    ("copy/memset", ("memcpy", "memset", "copy_kernel", "catarraybatchedcopy")),
    ("cross-entropy/softmax", ("softmax", "log_softmax", "cross_entropy", "logsumexp", "nll")),
)

# Ranges that record_function draws on the device timeline around kernels already counted (the optimizer's step).
ANNOTATIONS = ("Optimizer.", "ProfilerStep")


def group_of(kernel: str) -> str:
    name = kernel.lower()
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "element-wise/other")


def kernel_times(prof) -> dict[str, float]:
    """Seconds of device time per kernel (and per memcpy/memset) name."""
    out = {}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.key.startswith(ANNOTATIONS):
            continue
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        out[ev.key] = out.get(ev.key, 0.0) + t / 1e6
    return out


def attribute(fn, device: torch.device, table_to: Path | None = None) -> dict:
    """Run ``fn`` once under the profiler: wall and device-busy seconds, device seconds per group; with ``table_to``
    the 30 costliest kernels are written there."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = kernel_times(prof)
    groups: dict[str, float] = {}
    for name, seconds in kernels.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + seconds
    busy = sum(kernels.values())
    if table_to is not None:
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:30]
        lines = [f"wall {wall * 1e3:.1f} ms, device busy {busy * 1e3:.1f} ms"]
        lines += [f"{s * 1e3:9.2f} ms  {group_of(n):22s} {n[:110]}" for n, s in top]
        table_to.write_text("\n".join(lines) + "\n")
    return {"wall_s": wall, "device_busy_s": busy, "idle_s": wall - busy,
            **{f"device_{g}_s": s for g, s in sorted(groups.items())}}
