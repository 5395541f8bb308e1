"""Megatron's optimizer helpers on foreach kernels, on the GPU (run on the device: BENCHMARKS.md says when and
where): the grad norm of fp32 main gradients, the master weights' copy into bf16 model weights and the in-place
clipping give what Megatron's per-tensor fallbacks give. CPU runs skip it; the routing through Megatron is pinned in
CI by ``tests/megatron/test_multi_tensor.py``."""

import pytest
import torch

from rlfw.megatron import multi_tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA foreach kernels: run on the device (BENCHMARKS.md)")
def test_foreach_kernels_match_megatrons_fallbacks_on_the_gpu():
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(8960 * 2, 1536), (1536,), (151936, 1536), (256, 1536), (3,)]
    main = [torch.randn(s, generator=g, device=device) for s in shapes]
    ours, _ = multi_tensor.l2_norm(0, None, [main], False)
    theirs, _ = local_multi_tensor_l2_norm(0, None, [main], False)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)

    model, model_ref = ([torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes] for _ in range(2))
    multi_tensor.scale(0, None, [main, model], 1.0)
    local_multi_tensor_scale(0, None, [main, model_ref], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(model, model_ref))

    clipped = [t.clone() for t in main]
    multi_tensor.scale(0, None, [clipped, clipped], 0.3)
    assert all(torch.equal(c, t * 0.3) for c, t in zip(clipped, main))
