"""Megatron's grad norm and clipping on foreach kernels (``rlfw.megatron.multi_tensor``): the same results as
Megatron's per-tensor fallbacks, reached through Megatron's own module globals (private hooks, pinned here against
the installed megatron-core)."""

import pytest
import torch

from rlfw.megatron import multi_tensor
from rlfw.megatron.model import build_gpt, transformer_config
from rlfw.model.shape import ModelShape
from rlfw.megatron.trainer import megatron_adam

SHAPE = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=24, max_seq_len=16)


def tensors(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((7, 5), (3,), (64, 33), (1,))]


def test_l2_norm_is_the_norm_of_all_tensors_together():
    ts = tensors(0)
    total, per = multi_tensor.l2_norm(0, None, [ts], True)
    assert total.shape == (1,) and total.dtype == torch.float32
    torch.testing.assert_close(total[0], torch.linalg.vector_norm(torch.cat([t.flatten() for t in ts])))
    torch.testing.assert_close(per, torch.stack([torch.linalg.vector_norm(t) for t in ts]))
    assert multi_tensor.l2_norm(0, None, [ts], False)[1] is None
    halves = [t.to(torch.bfloat16) * 300 for t in ts]  # squares past bf16's precision: accumulated in fp32
    exact = torch.linalg.vector_norm(torch.cat([h.double().flatten() for h in halves]))
    assert multi_tensor.l2_norm(0, None, [halves], False)[0].dtype == torch.float32
    assert multi_tensor.l2_norm(0, None, [halves], False)[0].item() == pytest.approx(exact.item(), rel=1e-6)


def test_empty_lists_are_nothing_to_do():
    total, per = multi_tensor.l2_norm(0, torch.zeros(1, dtype=torch.int), [[]], True)
    assert total.tolist() == [0.0] and per.numel() == 0
    multi_tensor.scale(0, None, [[], []], 0.5)


def test_scale_copies_scales_and_casts():
    src = tensors(1)
    dst = tensors(2, torch.bfloat16)
    multi_tensor.scale(0, None, [src, dst], 1.0)  # the master weights' copy into the bf16 model weights
    assert all(torch.equal(d, s.to(torch.bfloat16)) for s, d in zip(src, dst))
    out = tensors(3)
    multi_tensor.scale(0, None, [src, out], 0.25)
    assert all(torch.equal(o, s * 0.25) for s, o in zip(src, out))
    before = [s.clone() for s in src]
    multi_tensor.scale(0, None, [src, src], 0.5)  # clipping, in place
    assert all(torch.equal(s, b * 0.5) for s, b in zip(src, before))


@pytest.fixture
def clip_grads(monkeypatch):
    """Megatron's clip_grads module with its globals as imported (without Apex or TE: the local fallbacks);
    restored after the test."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    return clip_grads


def test_install_replaces_only_megatrons_fallbacks(clip_grads, monkeypatch):
    assert multi_tensor.install()
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.scale
    apex_kernel = object()  # what Apex or TE would have bound: left alone
    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_kernel)
    assert multi_tensor.install() and clip_grads.l2_norm_impl is apex_kernel


def test_megatrons_clipping_reaches_scale(clip_grads):
    assert multi_tensor.install() and clip_grads.multi_tensor_scale_impl is multi_tensor.scale
    grads = tensors(6)
    expected = [g * 0.125 for g in grads]
    clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, torch.zeros(1, dtype=torch.int),
                                    [grads, grads], 0.125)  # the call clip_grad_by_total_norm_fp32 makes
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))


def test_megatrons_step_takes_its_grad_norm_from_the_foreach_kernels(megatron_world, clip_grads, monkeypatch):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    torch.manual_seed(0)
    config = transformer_config(SHAPE)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                    build_gpt(SHAPE, config))
    optimizer = megatron_adam(model, torch.device("cpu"), False, lr=1e-3, clip_grad=1e9)
    calls = []

    def spied(*args):
        calls.append(args[2][0])
        return multi_tensor.l2_norm(*args)

    monkeypatch.setattr(clip_grads, "l2_norm_impl", spied)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE.vocab_size, (1, 12), generator=g)
    mask = torch.tril(torch.ones(1, 1, 12, 12)) < 0.5
    (model(tokens, torch.arange(12)[None], mask) * torch.randn(1, 12, SHAPE.vocab_size, generator=g)).sum().backward()
    grads = [p.main_grad.clone() for p in model.module.parameters()]
    ok, grad_norm, _ = optimizer.step()
    assert ok and len(calls) == 1
    assert {id(t) for t in calls[0]} == {id(p.main_grad) for p in model.module.parameters()}  # every main grad
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    assert grad_norm == pytest.approx(expected, rel=1e-5)  # fp32 sums in another order
