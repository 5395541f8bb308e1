"""Import megatron-core without what its import pulls in for paths rlfw does not take: 5.3 CPU-seconds become 1.8.

Every cell pays megatron-core's import at start-up, and a run starts two cells (a test suite, dozens of runs). Two
parts of that import do nothing for rlfw's training:

* ``megatron.core.jit`` decorates its fused kernels with ``torch.compile`` at import time, and creating a compiled
  function imports TorchDynamo and Inductor's compiler (2.3 CPU-s), whether or not the function is ever called. On
  the CPU none is (the fusions are off there); on a GPU the fused SwiGLU and RoPE are. Here each decoration is
  deferred to the function's first call, which compiles exactly as before.
* ``megatron.core.inference.contexts.dynamic_context`` imports W&B if it can (0.7 CPU-s), for its inference
  engine's logging. rlfw's cells never run that engine, and rlfw's W&B runs live in the driver. During the import
  W&B is hidden (``sys.modules["wandb"] = None`` makes ``import wandb`` raise ImportError, which megatron-core
  handles); afterwards ``import wandb`` works again in the process.

Both only while ``megatron.core`` itself is imported (``import rlfw.megatron`` does it); a process that imported it
before keeps what it has. Pinned on megatron-core 0.16.1 by ``tests/megatron/test_lean_import.py``; on 0.19.2 the GPU
rows of BENCHMARKS.md (2026-12-07 17:05) trained through it, the fused SwiGLU compiled at its first call.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Iterator

import torch


def deferred_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile``'s signature, compiling at the first call: ``compile(fn, **kw)`` and ``@compile(**kw)``."""

    def compile_later(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **kwargs)
        compiled, lock = None, threading.Lock()

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                with lock:
                    if compiled is None:
                        compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return call

    return compile_later


@contextlib.contextmanager
def lean_import() -> Iterator[None]:
    """While the block runs: ``torch.compile`` defers its work to the first call, and W&B cannot be imported (unless
    this process already has it)."""
    real = torch.compile
    hide_wandb = "wandb" not in sys.modules
    torch.compile = deferred_compile(real)
    if hide_wandb:
        sys.modules["wandb"] = None
    try:
        yield
    finally:
        torch.compile = real
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


def import_megatron_core() -> None:
    """Import ``megatron.core`` under ``lean_import`` unless this process already has it."""
    if "megatron.core" in sys.modules:
        return
    with lean_import():
        import megatron.core  # noqa: F401
