"""Numerics of the packed attention on the device: a 2-layer model of the benchmark's shape on one packed row, bf16
with ``SDPAttention`` (sequence offsets, and a recognised dense mask) against fp32 Megatron attention with the dense
mask and the same weights: ||x - ref|| / ||ref|| of the logits and of layer 0's QKV weight gradient."""

from __future__ import annotations

import torch

from rlfw.model.shape import ModelShape


def check_packed_attention(shape: ModelShape, device: torch.device, results) -> None:
    from megatron.core import tensor_parallel

    from rlfw.megatron.attention import packed_row, segments_to_cu_seqlens
    from rlfw.megatron.model import build_gpt, transformer_config
    from rlfw.megatron.packing import block_causal_mask

    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=device.type == "cpu")
    small = ModelShape(**{**shape.__dict__, "num_layers": 2, "vocab_size": min(shape.vocab_size, 32000)})
    lengths = [1000, 37, 2048, 1011] if shape.max_seq_len >= 4096 else [50, 3, 100, 40]
    T = sum(lengths)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, small.vocab_size, (1, T), generator=g).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    mask = block_causal_mask(torch.tensor(lengths)).to(device)
    cu, longest = segments_to_cu_seqlens(lengths, device)
    half = device.type == "cuda"

    def run(attention: str, bf16: bool, state=None, **inputs):
        torch.manual_seed(0)
        config = transformer_config(small, bf16=bf16)
        config.gradient_accumulation_fusion = False  # no DDP here: the gradients go to .grad, not main gradients
        model = build_gpt(small, config, core_attention=attention).to(device)
        if state is not None:
            model.load_state_dict(state)
        logits = model(tokens, positions, **inputs)
        logits.float().pow(2).mean().backward()
        return model, logits.detach().float(), model.decoder.layers[0].self_attention.linear_qkv.weight.grad.float()

    reference, ref_logits, ref_grad = run("megatron", False, attention_mask=mask)
    state = reference.state_dict()
    cases = {
        "sdpa, offsets (PackedRow)": {"attention_mask": None, "packed_seq_params": packed_row(cu, longest, T)},
        "sdpa, dense mask (recognised)": {"attention_mask": mask},
    }
    for label, inputs in cases.items():
        try:
            _, logits, grad = run("sdpa", half, state, **inputs)
            row = results.record(kind="check", name=f"{label}, {'bf16' if half else 'fp32'} vs fp32 Megatron",
                                 logits_rel_err=((logits - ref_logits).norm() / ref_logits.norm()).item(),
                                 qkv_grad_rel_err=((grad - ref_grad).norm() / ref_grad.norm()).item())
            print(row, flush=True)
        except Exception as exc:  # noqa: BLE001  (a failed check is reported, the timings still run)
            results.failed(label, exc)
