"""Weights packed into one buffer for a same-GPU push: every tensor comes back as it went in, aligned, as views."""

import torch

from rlfw.model.device_weights import ALIGN, pack


def test_packed_weights_are_views_of_one_buffer_that_read_back_exactly():
    g = torch.Generator().manual_seed(0)
    state = {"embed": torch.randn(7, 5, generator=g).to(torch.bfloat16), "norm": torch.randn(5, generator=g),
             "bias": torch.randn(3, generator=g).to(torch.float16), "scalar": torch.tensor(2.5)}
    packed = pack(state)
    views = packed.tensors()
    assert list(views) == list(state)
    for name, tensor in state.items():
        assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor)
        assert views[name].untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr()
        assert (views[name].data_ptr() - packed.buffer.data_ptr()) % ALIGN == 0
    packed.buffer.zero_()  # views, not copies
    assert all(torch.count_nonzero(v) == 0 for v in views.values())
