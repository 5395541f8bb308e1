"""The finite check before every optimizer step, on the GPU (run on the device; CI pins it on CPU in
``tests/megatron/test_finite_check.py``): the CUDA inf-norm reduction must carry a NaN or inf from any block of a
large buffer, and allocate nothing the size of the buffer."""

import pytest
import torch

from rlfw.megatron.trainer import all_finite

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA reduction: run on the device")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_gradient_anywhere_is_found_on_the_gpu(bad):
    buffers = [torch.randn(1 << 26, device="cuda"), torch.randn(12345, device="cuda")]
    assert all_finite(buffers)
    for t in buffers:
        for where in (0, t.numel() // 3, t.numel() - 1):
            saved = t[where].item()
            t[where] = bad
            assert not all_finite(buffers), (t.numel(), where)
            t[where] = saved
    assert all_finite(buffers)


def test_the_check_allocates_nothing_the_size_of_a_buffer():
    buffer = torch.randn(1 << 26, device="cuda")  # 256 MiB
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert all_finite([buffer])
    assert torch.cuda.max_memory_allocated() - before < 1 << 20
