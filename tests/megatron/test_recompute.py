"""``model.recompute``: activation recompute trades memory for time and must not change the math. Each mode gives
the same loss and the same gradients, bitwise, as no recompute, and really runs the modules again in the backward
(counted with forward hooks), so a knob that is read but not wired fails here. The memory it saves on the H200 is in
BENCHMARKS.md."""

import pytest
import torch

from rlfw.megatron.model import build_gpt, recompute_options, transformer_config
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=24, max_seq_len=16)


def step(recompute: str, modules=("mlp",)):
    """Loss, gradients by name, and how often each kind of module ran forward in one forward + backward."""
    torch.manual_seed(0)
    model = build_gpt(SHAPE, transformer_config(SHAPE, recompute=recompute, recompute_modules=modules))
    calls = {"mlp": 0, "layernorm": 0, "self_attention": 0, "core_attention": 0}

    def count(kind):
        def hook(*_):
            calls[kind] += 1
        return hook

    for layer in model.decoder.layers:
        layer.mlp.register_forward_hook(count("mlp"))
        layer.self_attention.register_forward_hook(count("self_attention"))
        layer.self_attention.core_attention.register_forward_hook(count("core_attention"))
        for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
            norm.register_forward_hook(count("layernorm"))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE.vocab_size, (1, 12), generator=g)
    mask = torch.tril(torch.ones(1, 1, 12, 12)) < 0.5
    target = torch.randn(1, 12, SHAPE.vocab_size, generator=g)
    loss = (model(tokens, torch.arange(12)[None], mask) * target).sum()
    loss.backward()
    return loss.detach(), {n: p.main_grad if hasattr(p, "main_grad") else p.grad
                           for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("recompute,modules,again", [
    ("selective", ("mlp",), {"mlp"}),
    ("selective", ("core_attn", "mlp"), {"core_attention", "mlp"}),
    ("full", (), {"layernorm", "mlp", "self_attention", "core_attention"}),
])
def test_recompute_keeps_the_math_and_runs_the_modules_again(megatron_world, recompute, modules, again):
    loss, grads, calls = step("none")
    assert calls == {"mlp": 2, "layernorm": 4, "self_attention": 2, "core_attention": 2}  # one forward, two layers
    loss_r, grads_r, calls_r = step(recompute, modules)
    assert torch.equal(loss_r, loss)
    assert grads_r.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grads_r[name], grad), name
    assert {kind for kind in calls if calls_r[kind] == 2 * calls[kind]} == again
    assert all(calls_r[kind] == calls[kind] for kind in calls if kind not in again)


def test_bad_recompute_options_are_refused():
    assert recompute_options("none") == {}
    with pytest.raises(ValueError, match="recompute must be one of"):
        recompute_options("partial")
    with pytest.raises(ValueError, match="recompute_modules"):
        recompute_options("selective", ("mlp", "layernorm"))  # needs Transformer Engine
    with pytest.raises(ValueError, match="recompute_modules"):
        recompute_options("selective", ())
