"""The model's description: the architecture numbers every part agrees on.

The trainer builds its Megatron model from it (``rlfw.megatron.model``), the engines build theirs or an HF config
from it (``rlfw.model.hf_convert``), so it lives below both and imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelShape:
    """Architecture numbers shared by the trainer, the engines and the HF export."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_epsilon: float = 1e-5
    head_dim: int | None = None  # width of one attention head (Megatron kv_channels); None = hidden / heads
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_layernorm: bool = False  # RMSNorm over every query and key head before RoPE (Qwen3)
    tie_word_embeddings: bool = False  # the output layer reuses the input embedding matrix
    # Llama 3.x RoPE scaling (HF rope_type "llama3" with Megatron's fixed low/high frequency factors 1 and 4 and
    # original context 8192): the factor; None = plain RoPE.
    rope_scaling_factor: float | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
