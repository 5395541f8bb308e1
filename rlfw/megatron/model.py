"""Build the policy as a Megatron-core ``GPTModel`` (Llama-style: RoPE, RMSNorm, SwiGLU, no output biases).

Three switches cover the Hugging Face families rlfw converts one-to-one (see ``rlfw.model.hf_convert``):
``qkv_bias`` (Qwen2), ``qk_layernorm`` (Qwen3) and ``tie_word_embeddings``; with none of them it is
``LlamaForCausalLM``. The Megatron *local* layer spec is used
on every device, with ``rlfw.megatron.attention.SDPAttention`` (PyTorch's fused kernels) as its core attention
unless ``core_attention="megatron"`` asks for Megatron's unfused one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfw.model.shape import ModelShape


RECOMPUTE = ("none", "selective", "full")
# Megatron's selective recompute modules of a dense layer on the local spec. Its "layernorm" recompute is left out:
# its CheckpointWithoutOutput reads Transformer Engine's FP8 state (megatron-core 0.16.1 and 0.19.2 raise NameError
# without TE), and the local spec runs without TE.
RECOMPUTE_MODULES = ("core_attn", "mlp")


def recompute_options(recompute: str = "none", modules=("mlp",)) -> dict:
    """TransformerConfig's activation-recompute fields. ``selective``: Megatron keeps only the inputs of
    ``modules`` and runs them again in the backward (``mlp``: fc1, SwiGLU and fc2, whose activations are most of a
    layer's; ``core_attn``: Megatron's unfused attention and its scores; the flash kernel keeps no scores, so there
    it saves nothing). ``full``: only each layer's input is kept, its whole forward runs again. The math is the same
    with and without: only memory and time change (``tests/megatron/test_recompute.py``)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, not {recompute!r}")
    if recompute == "none":
        return {}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
    if unknown or not modules:
        raise ValueError(f"recompute_modules must be a non-empty subset of {RECOMPUTE_MODULES}, not {list(modules)}")
    return {"recompute_granularity": "selective", "recompute_modules": list(modules)}


def transformer_config(shape: ModelShape, tp: int = 1, pp: int = 1, bf16: bool = False, recompute: str = "none",
                       recompute_modules=("mlp",), device: torch.device | None = None):
    """Megatron's config for ``shape``. ``device``: where the model trains (None: CUDA if this process sees a GPU).
    The CUDA-only fusions follow it, not the GPUs visible: a CPU trainer on a GPU host keeps the CPU path."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlfw.megatron import rope, wgrad

    on_cpu = device.type != "cuda" if device is not None else not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        kv_channels=shape.head_dim,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        # CUDA: Megatron's fused SwiGLU (one compiled kernel; only fc1's output is kept for the backward): 10 %
        # off the H200 step and 15 GiB off its peak (BENCHMARKS.md). On CPU torch.compile would need a compiler.
        bias_activation_fusion=not on_cpu,
        # CUDA: RoPE as one compiled kernel each way (rlfw.megatron.rope), where TE does not bring its own.
        apply_rope_fusion=not on_cpu and rope.install(),
        # CUDA: each micro-batch's weight gradients accumulated into DDP's fp32 main gradients by the GEMM itself
        # (rlfw.megatron.wgrad), not by a separate addition. A model trained without Megatron DDP has no main
        # gradients and must turn it off (bench/gpu/checks.py does).
        gradient_accumulation_fusion=not on_cpu and wgrad.install(),
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=on_cpu,
        # rlfw normalises every loss by the step's global denominator itself (the dynamic global batch size):
        # Megatron must neither divide by the number of micro-batches nor average gradients over DP ranks.
        calculate_per_token_loss=True,
        sequence_parallel=False,
        **recompute_options(recompute, recompute_modules),
    )


CORE_ATTENTION = ("auto", "sdpa", "megatron")


def layer_spec(shape: ModelShape, core_attention: str = "auto"):
    """The transformer layer spec. ``core_attention``: ``"megatron"`` is Megatron's local spec with its unfused
    ``DotProductAttention``; ``"sdpa"`` the local spec with ``rlfw.megatron.attention.SDPAttention`` (PyTorch's fused
    kernels, varlen flash for packed rows on CUDA, one padded batch of a row's sequences on the CPU); ``"auto"`` is
    SDPA on every device: on the CPU Megatron's attention over a packed row of short sequences computes the row's
    whole T x T score matrix under a block mask, 2.3x the step time of SDPA's padded batch in ``bench_cpu_step``
    (BENCHMARKS.md).

    Transformer Engine's spec is not used: its attention reads sequence offsets only in THD format, not from the
    ``PackedRow`` (``sbhd``) that carries rlfw's packed rows, so sequences packed into one row would attend to each
    other."""
    if core_attention not in CORE_ATTENTION:
        raise ValueError(f"core_attention must be one of {CORE_ATTENTION}, not {core_attention!r}")
    if core_attention == "auto":
        core_attention = "sdpa"
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_layernorm)
    if core_attention == "sdpa":
        from rlfw.megatron.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_gpt(shape: ModelShape, config, core_attention: str = "auto", post_process: bool = True) -> torch.nn.Module:
    """A GPTModel for this pipeline stage (parallel_state must be initialised); ``post_process=False`` leaves out
    the final norm and output layer on every stage (the critic's trunk, ``rlfw.megatron.critic``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(shape, core_attention),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=post_process and parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 1.0,  # read only with rope_scaling
    )
    if config.params_dtype != torch.float32:
        # The local spec's torch norms (WrappedTorchNorm) ignore params_dtype and keep fp32 weights; with bf16
        # activations torch.rms_norm then falls back to its unfused composite ("Mismatch dtype between input and
        # weight"). The optimizer keeps fp32 master copies of these weights like of every other bf16 weight.
        for module in model.modules():
            if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
                module.to(dtype=config.params_dtype)
    return model


def takes_sequence_offsets(model: torch.nn.Module) -> bool:
    """Whether ``model``'s core attention takes packed rows as sequence offsets (``SDPAttention``); Megatron's
    unfused ``DotProductAttention`` refuses ``packed_seq_params`` and needs the dense block-diagonal mask."""
    from rlfw.megatron.attention import SDPAttention

    return any(isinstance(m, SDPAttention) for m in model.modules())
