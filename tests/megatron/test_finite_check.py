"""The finite check before every optimizer step: it must find any NaN or inf in the grad buffers, and hold no more
than a chunk of extra memory while it looks (a whole-buffer ``torch.isfinite`` once set a 1.8B-parameter model's
peak memory, BENCHMARKS.md)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rlfw.megatron.policy import all_finite


@pytest.mark.parametrize("where", [0, 999, 1000, 1001, 4999])  # first, chunk edges, last
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_nonfinite_element_is_found(where, bad):
    buffers = [torch.randn(3000), torch.randn(5000)]
    assert all_finite(buffers, chunk=1000)
    buffers[1][where] = bad
    assert not all_finite(buffers, chunk=1000)
    assert not all_finite(buffers[::-1], chunk=1000)


def test_nothing_to_check_is_finite():
    assert all_finite([])
    assert all_finite([torch.empty(0)])


def largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


def test_extra_memory_is_one_chunk():
    buffer = torch.randn(4 << 20)  # 16 MiB of fp32
    whole = largest_allocation(lambda: all_finite([buffer], chunk=buffer.numel()))
    chunked = largest_allocation(lambda: all_finite([buffer], chunk=1 << 18))
    assert whole >= buffer.numel() * 4  # isfinite copies the whole buffer (abs) ...
    assert chunked <= (1 << 18) * 4  # ... a chunk at a time, a chunk's worth
