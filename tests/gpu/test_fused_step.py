"""A whole ``PolicyTrainer`` step in bf16 on the GPU with rlfw's CUDA fusions on (SwiGLU, RoPE, the weight gradients
accumulated in the GEMM, the compiled head) and with full activation recompute, against the same step on plain
PyTorch math (run on the device: BENCHMARKS.md says when and where). The main gradients of every weight and the
loss must be as close to an fp32 step from the same weights as the unfused bf16 step is: a fusion that changed the
math (a sign, a missed accumulation, a wrong row) would be off by far more than bf16 round-off. CPU runs skip it;
each fusion's routing through Megatron is pinned in CI (``tests/megatron/test_rope.py``, ``test_wgrad.py``,
``test_head.py``, ``test_recompute.py``)."""

import pytest
import torch

from bench.gpu import setup
from bench.gpu.data import rollout_batch
from rlfw.megatron.model import ModelShape

SHAPE = ModelShape(num_layers=4, hidden_size=1024, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=2816,
                   vocab_size=32000, max_seq_len=2048, rope_theta=1e6)


def step(trainer, batch):
    """The loss and the concatenated fp32 main gradients of one forward/backward with DDP's reduction."""
    trainer.zero_grad()
    out = trainer.forward_backward(batch)
    trainer.model.finish_grad_sync()
    return out["loss"], torch.cat([b.float().flatten() for b in trainer.grad_buffers()]).clone()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU: run on the device (BENCHMARKS.md)")
def test_the_fused_bf16_step_is_as_close_to_fp32_as_the_unfused_one():
    device = torch.device("cuda", 0)
    setup.init_world(device)
    batch = rollout_batch(SHAPE, [700, 1300, 2048, 90, 1958, 1000], seed=3)  # two packed rows of 4096 tokens
    fused = setup.build_trainer(SHAPE, device, bf16=True, budget=4096)
    assert fused.config.bias_activation_fusion and fused.config.apply_rope_fusion
    assert fused.config.gradient_accumulation_fusion
    reference = setup.build_trainer(SHAPE, device, bf16=False, budget=4096)
    reference.model.module.load_state_dict(fused.model.module.state_dict())  # the bf16 weights, in fp32
    with setup.fusions_off(reference):
        ref_loss, ref_grads = step(reference, batch)

    loss, grads = step(fused, batch)
    with setup.fusions_off(fused):
        plain_loss, plain_grads = step(fused, batch)
    config = fused.config
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    try:
        recomputed_loss, recomputed_grads = step(fused, batch)
    finally:
        config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None

    plain = rel(plain_grads, ref_grads)
    assert 0 < plain < 0.05, plain  # bf16 round-off, not a different function
    assert rel(grads, ref_grads) <= 1.25 * plain, (rel(grads, ref_grads), plain)
    assert rel(recomputed_grads, ref_grads) <= 1.25 * plain, (rel(recomputed_grads, ref_grads), plain)
    for name, value in (("fused", loss), ("recomputed", recomputed_loss)):
        assert abs(value - ref_loss) <= 1.25 * abs(plain_loss - ref_loss) + 1e-3 * abs(ref_loss), name
