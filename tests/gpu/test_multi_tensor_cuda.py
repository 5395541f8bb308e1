"""Megatron's grad norm and clipping on foreach kernels, on the GPU (run on the device: BENCHMARKS.md says when and
where): the kernels give what Megatron's per-tensor fallbacks give, and a clipped bf16 optimizer step through them
clips like the step on the fallbacks. CPU runs skip it; the routing through Megatron is pinned in CI by
``tests/megatron/test_multi_tensor.py``."""

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA foreach kernels: run on the device (BENCHMARKS.md)")
def test_megatrons_clipped_step_is_the_same_on_foreach_kernels(cuda_world):
    """Megatron's bf16 optimizer step with clipping, its grad norm and clipping on foreach kernels, against the same
    step on Megatron's per-tensor loops: the same norm, and the gradients scaled to the limit alike."""
    from bench.gpu import setup
    from bench.gpu.data import rollout_batch
    from rlfw.model.shape import ModelShape

    shape = ModelShape(num_layers=2, hidden_size=512, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1408,
                       vocab_size=8000, max_seq_len=1024)
    batch = rollout_batch(shape, [300, 1000, 724, 60], seed=5)

    def clipped_step():
        trainer = setup.build_trainer(shape, cuda_world, bf16=True, budget=2048)  # the same weights every time
        trainer.optimizer.config.clip_grad = 1e-3  # far below the norm: every step clips
        trainer.zero_grad()
        trainer.forward_backward(batch)
        trainer.model.finish_grad_sync()
        before = [b.clone() for b in trainer.grad_buffers()]
        norm = trainer.optimizer_step()
        return norm, before, [b.clone() for b in trainer.grad_buffers()]

    norm, before, after = clipped_step()
    with setup.megatron_fallbacks():
        norm_ref, _, after_ref = clipped_step()
    assert norm == pytest.approx(norm_ref, rel=1e-3) and norm > 1e-2
    for b, a in zip(before, after):  # clipped in place, to the limit
        torch.testing.assert_close(a, b * (1e-3 / (norm + 1e-6)), rtol=1e-5, atol=1e-12)
    for a, a_ref in zip(after, after_ref):  # flash attention's backward sums in another order from run to run
        assert ((a - a_ref).norm() / a_ref.norm()).item() < 1e-2
