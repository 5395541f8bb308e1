"""A whole ``PolicyTrainer`` step in bf16 on the GPU with rlfw's CUDA fusions on (SwiGLU, RoPE, the weight gradients
accumulated in the GEMM, the compiled head) and with full activation recompute, against the same step on plain
PyTorch math (run on the device: BENCHMARKS.md says when and where). Every weight's main gradient and the loss must
be as close to an fp32 step from the same weights as the unfused bf16 step is: a fusion that changed the math (a
sign, a missed accumulation, a wrong row) is off by far more than bf16 round-off, in the weights it touches. CPU runs
skip it; each fusion's routing through Megatron is pinned in CI (``tests/megatron/test_rope.py``, ``test_wgrad.py``,
``test_head.py``, ``test_recompute.py``)."""

import pytest
import torch

from bench.gpu import setup
from bench.gpu.data import rollout_batch
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(num_layers=4, hidden_size=1024, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=2816,
                   vocab_size=32000, max_seq_len=2048, rope_theta=1e6)


def step(trainer, batch):
    """The loss and each weight's fp32 main gradient after one forward/backward and DDP's reduction."""
    trainer.zero_grad()
    out = trainer.forward_backward(batch)
    trainer.model.finish_grad_sync()
    return out["loss"], {n: p.main_grad.float().clone() for n, p in trainer.model.module.named_parameters()}


def distance(grads, reference) -> dict:
    """Per weight: the relative L2 distance from the reference gradient."""
    return {n: ((g - reference[n]).norm() / reference[n].norm().clamp_min(1e-30)).item() for n, g in grads.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU: run on the device (BENCHMARKS.md)")
def test_the_fused_bf16_step_is_as_close_to_fp32_as_the_unfused_one(cuda_world):
    device = cuda_world
    batch = rollout_batch(SHAPE, [700, 1300, 2048, 90, 1958, 1000], seed=3)  # rows of 4096 and 3000 tokens
    fused = setup.build_trainer(SHAPE, device, bf16=True, budget=4096)
    assert fused.config.bias_activation_fusion and fused.config.apply_rope_fusion
    assert fused.config.gradient_accumulation_fusion
    reference = setup.build_trainer(SHAPE, device, bf16=False, budget=4096)
    reference.model.module.load_state_dict(fused.model.module.state_dict())  # the bf16 weights, in fp32
    with setup.fusions_off(reference):
        # old log-probs from the fp32 model: ratios near 1, far from the clip, so round-off flips no token's clip
        batch.samples["old_logprobs"] = reference.logprobs(batch)["old_logprobs"]
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

    plain = distance(plain_grads, ref_grads)
    assert max(plain.values()) < 0.1, plain  # bf16 round-off, not a different function
    for name, grads_of in (("fused", grads), ("recomputed", recomputed_grads)):
        off = {n: (d, plain[n]) for n, d in distance(grads_of, ref_grads).items() if d > 1.25 * plain[n] + 2e-3}
        assert not off, (name, off)  # weight: (its distance, the unfused step's)
    loss_scale = 1e-3 * max(1.0, abs(ref_loss))
    for name, value in (("fused", loss), ("recomputed", recomputed_loss)):
        assert abs(value - ref_loss) <= 1.25 * abs(plain_loss - ref_loss) + loss_scale, (name, value, ref_loss)
