"""``rlfw.megatron.norm``: the compiled RMSNorm's formula is torch's RMSNorm (values and both gradients), and the
swap a CUDA model gets keeps every weight, name and output. The compiled kernels themselves run on the device
(``tests/gpu/test_norm_bf16.py``); here the same formula runs uncompiled on CPU."""

import pytest
import torch
import torch.nn.functional as F

from rlfw.megatron.model import ModelShape, build_gpt, transformer_config
from rlfw.megatron.norm import CompiledRMSNorm, compile_norms, rms_norm

SHAPE = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=24, max_seq_len=16, norm_epsilon=1e-6, qk_layernorm=True)


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_the_formula_is_torchs_rmsnorm(eps):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2, 48, generator=g, dtype=torch.float64)
    weight = torch.randn(48, generator=g, dtype=torch.float64)
    upstream = torch.randn(7, 2, 48, generator=g, dtype=torch.float64)

    def run(fn):
        xi, wi = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fn(xi, wi)
        return (out, *torch.autograd.grad(out, (xi, wi), upstream))

    ours = run(lambda a, w: rms_norm(a, w, eps))
    torchs = run(lambda a, w: F.rms_norm(a, (48,), w, eps))
    for a, b in zip(ours, torchs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(rms_norm(x, weight, 1.0), torchs[0])  # eps is really read


def test_a_cuda_model_gets_compiled_norms_with_the_same_weights_and_outputs(megatron_world):
    torch.manual_seed(0)
    config = transformer_config(SHAPE, device=torch.device("cpu"))
    plain = build_gpt(SHAPE, config, core_attention="megatron", device=torch.device("cpu"))
    assert not any(isinstance(m, CompiledRMSNorm) for m in plain.modules())  # CPU training keeps torch's
    torch.manual_seed(0)
    swapped = build_gpt(SHAPE, config, core_attention="megatron", device=torch.device("cuda"))
    norms = [m for m in swapped.modules() if isinstance(m, torch.nn.RMSNorm)]
    # two per layer, a query and a key norm per layer (qk_layernorm), the final norm
    assert len(norms) == 4 * SHAPE.num_layers + 1 and all(type(m) is CompiledRMSNorm for m in norms)
    assert swapped.state_dict().keys() == plain.state_dict().keys()
    for (name, a), b in zip(plain.state_dict().items(), swapped.state_dict().values()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name

    tokens = torch.randint(0, SHAPE.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.tril(torch.ones(1, 1, 12, 12)) < 0.5

    def grads(model):
        model.zero_grad()
        out = model(tokens, torch.arange(12)[None], mask)
        out.square().sum().backward()
        return out, {n: p.main_grad if hasattr(p, "main_grad") else p.grad for n, p in model.named_parameters()}

    (out_a, grads_a), (out_b, grads_b) = grads(plain), grads(swapped)
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-5)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_swap_keeps_each_parameter_object_and_goes_back():
    model = torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-6), torch.nn.Sequential(torch.nn.RMSNorm(8)))
    params = list(model.parameters())
    assert compile_norms(model) == 2 and compile_norms(model) == 0
    assert [type(m) for m in (model[0], model[1][0])] == [CompiledRMSNorm] * 2
    assert list(model.parameters()) == params and model[0].eps == 1e-6 and model[1][0].eps is None
    assert compile_norms(model, compiled=False) == 2
    assert type(model[0]) is torch.nn.RMSNorm and list(model.parameters()) == params
