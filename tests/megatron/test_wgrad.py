"""``rlfw.megatron.wgrad``: Megatron's linear layers, with ``gradient_accumulation_fusion``, accumulate their weight
gradients into the main gradients through rlfw's function (Megatron's private Apex hook), and the main gradients
equal the unfused weight gradients. The bf16 accumulation on CUDA is pinned in ``tests/gpu/test_wgrad_bf16.py``."""

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel import layers

from rlfw.megatron import wgrad
from rlfw.megatron.model import build_gpt, transformer_config
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=24, max_seq_len=16)


def test_install_hands_megatron_the_accumulation(monkeypatch):
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not wgrad.install() and not layers._grad_accum_fusion_available  # no CUDA: Megatron's default stays
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(wgrad, "works_on", lambda device: False)
    assert not wgrad.install()  # a torch without the mixed-precision addmm: left off
    monkeypatch.setattr(wgrad, "works_on", lambda device: True)
    assert wgrad.install() and layers._grad_accum_fusion_available
    assert layers.fused_weight_gradient_mlp_cuda is wgrad.WGRAD_ACCUMULATE


def test_megatron_linear_layers_accumulate_into_the_main_grads(megatron_world, monkeypatch):
    calls = []

    def counted(total_input, grad_output, main_grad):
        calls.append(tuple(main_grad.shape))
        wgrad.accumulate_fp32(total_input, grad_output, main_grad)

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda",
                        type(wgrad.WGRAD_ACCUMULATE)(wgrad_gemm_accum_fp32=counted), raising=False)

    def gradients(fused: bool):
        torch.manual_seed(0)
        config = transformer_config(SHAPE)
        config.gradient_accumulation_fusion = fused  # off on CPU by default; the layers read it when built
        model = build_gpt(SHAPE, config)
        for p in model.parameters():  # what Megatron DDP gives every weight: an fp32 main gradient, starting at 1
            p.main_grad = torch.ones_like(p, dtype=torch.float32)
        tokens = torch.randint(0, SHAPE.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
        mask = torch.tril(torch.ones(1, 1, 12, 12)) < 0.5
        target = torch.randn(1, 12, SHAPE.vocab_size, generator=torch.Generator().manual_seed(2))
        (model(tokens, torch.arange(12)[None], mask) * target).sum().backward()
        return {n: (p.main_grad.clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}

    unfused = gradients(False)
    assert calls == [] and all(grad is not None for _, grad in unfused.values())
    fused = gradients(True)
    linear = [n for n, (_, grad) in fused.items() if grad is None]  # accumulated by the GEMM: no .grad at all
    assert len(calls) == len(linear) == 4 * SHAPE.num_layers + 1  # qkv, proj, fc1, fc2 per layer; the output layer
    for name in linear:
        torch.testing.assert_close(fused[name][0], 1 + unfused[name][1], rtol=1e-5, atol=1e-5)
    for name in set(fused) - set(linear):  # embedding and norms: autograd's .grad, for DDP's hook to add
        torch.testing.assert_close(fused[name][1], unfused[name][1], rtol=0, atol=0)


def test_accumulate_adds_the_weight_gradient():
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(9, 5, generator=g), torch.randn(9, 3, generator=g)
    main_grad = torch.randn(3, 5, generator=g)
    expected = main_grad + dy.t() @ x
    wgrad.accumulate_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad, expected)


def test_the_cuda_fusions_follow_the_trainers_device_not_the_visible_gpus(monkeypatch):
    """``cluster.device=cpu`` on a GPU host: the CPU trainer keeps the CPU path (a fused weight-gradient
    accumulation there would hand DDP a CUDA placeholder gradient for a CPU weight)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(wgrad, "install", lambda: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)  # restored after: rope.install sets it
    on_cpu = transformer_config(SHAPE, device=torch.device("cpu"))
    assert not (on_cpu.gradient_accumulation_fusion or on_cpu.apply_rope_fusion or on_cpu.bias_activation_fusion)
    assert on_cpu.use_cpu_initialization
    on_gpu = transformer_config(SHAPE, device=torch.device("cuda", 0))
    assert on_gpu.gradient_accumulation_fusion and on_gpu.apply_rope_fusion and on_gpu.bias_activation_fusion
