"""The benchmark's model shapes, the FLOPs of a step, and the bf16 matmul rate they are measured against.

FLOPs per step (forward + backward = 3 x forward):
    model_flops = 6 * N * tokens + 12 * L * (heads * head_dim) * sum_i(n_i ** 2)
where N = matmul weights = L * (h * (heads * d + 2 * g * d) + heads * d * h + 3 * h * ffn) + h * V (no input
embedding, no norms) and n_i are the lengths of the step's sequences. The attention term is the usual 12 * L * h * s
per token with s = the token's own sequence length (packing adds no attention work); it counts the full score
matrix (PaLM / Megatron convention); ``causal`` halves it (the work a causal kernel does).
"""

from __future__ import annotations

import statistics

import torch

from rlfw.model.shape import ModelShape

QWEN2_1P5B = ModelShape(
    num_layers=28, hidden_size=1536, num_attention_heads=12, num_query_groups=2, ffn_hidden_size=8960,
    vocab_size=151936, max_seq_len=4096, rope_theta=1e6, norm_epsilon=1e-6,
)
TINY = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, vocab_size=512,
    max_seq_len=256,
)
DATASHEET_BF16 = 989e12  # H100/H200 SXM dense bf16, FLOP/s


def matmul_weights(shape: ModelShape) -> int:
    h, d, g, f = shape.hidden_size, shape.head_dim, shape.num_query_groups, shape.ffn_hidden_size
    q = shape.num_attention_heads * d
    per_layer = h * (q + 2 * g * d) + q * h + 3 * h * f
    return shape.num_layers * per_layer + h * shape.vocab_size


def model_flops(shape: ModelShape, lengths) -> tuple[float, float]:
    """(full, causal) forward + backward FLOPs of one step over sequences of ``lengths``."""
    dense = 6.0 * matmul_weights(shape) * sum(lengths)
    attn = 12.0 * shape.num_layers * shape.num_attention_heads * shape.head_dim * sum(n * n for n in lengths)
    return dense + attn, dense + attn / 2


def matmul_rate(n: int = 8192, reps: int = 20) -> float:
    """bf16 FLOP/s of an n^3 ``torch.matmul`` on random data: the median of CUDA-event-timed repeats."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * n**3 / statistics.median(times)
