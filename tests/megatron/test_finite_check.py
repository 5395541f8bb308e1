"""The finite check before every optimizer step: it must find any NaN or inf in the grad buffers, and hold no
temporary the size of a buffer while it looks (a whole-buffer ``torch.isfinite`` once set a 1.8B-parameter model's
peak memory, BENCHMARKS.md)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rlfw.megatron.trainer import all_finite


@pytest.mark.parametrize("where", [0, 999, 1000, 1001, 4999])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_nonfinite_element_is_found(where, bad):
    buffers = [torch.randn(3000), torch.randn(5000)]
    assert all_finite(buffers)
    buffers[1][where] = bad
    assert not all_finite(buffers)
    assert not all_finite(buffers[::-1])


def test_the_largest_finite_values_are_finite():
    big = torch.finfo(torch.float32).max
    assert all_finite([torch.tensor([big, -big, 1.0]), torch.tensor([big], dtype=torch.float64)])


def test_nothing_to_check_is_finite():
    assert all_finite([])
    assert all_finite([torch.empty(0)])
    assert not all_finite([torch.empty(0), torch.tensor([float("nan")])])


def largest_allocation(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


def test_no_temporary_the_size_of_a_buffer():
    buffer = torch.randn(4 << 20)  # 16 MiB of fp32
    assert largest_allocation(lambda: bool(torch.isfinite(buffer).all())) >= buffer.numel()  # what it replaced
    assert largest_allocation(lambda: all_finite([buffer, buffer])) < 1024
