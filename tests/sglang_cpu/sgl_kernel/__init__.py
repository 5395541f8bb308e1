"""Stands in for SGLang's compiled kernel package `sgl_kernel`, whose CPU build is source-only (Intel AMX) and not on PyPI.

SGLang's CPU server imports it at start; on its path (``--device cpu --attention-backend torch_native``) only
``assign_req_to_token_pool_cpu`` is ever called, written here in torch after SGLang's own Triton kernel
(``sglang/srt/mem_cache/allocation.py``). Every other top-level name resolves to an op that raises when called, so a
server that leaves that path fails loudly instead of computing something else; submodules (``sgl_kernel.x``) do not
exist, and SGLang falls back where it imports one under ``try``.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+rlfw.cpu-stand-in"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Request ``i``'s token slots ``start_offset[i]:end_offset[i]`` take the next entries of ``out_cache_loc``."""
    assert req_to_token.shape[1] == pool_len
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start].to(req_to_token.dtype)
        taken += end - start


def _missing(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in rlfw's CPU stand-in for sgl_kernel (tests/sglang_cpu)")

    op.__name__ = name.rpartition(".")[2]
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
