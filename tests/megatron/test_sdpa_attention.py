"""SDPAttention computes what Megatron's unfused DotProductAttention computes (CPU, fp32).

Same weights, two GPTModels that differ only in their core attention: logits (and gradients) agree within 1e-5 on
packed rows, given to SDPAttention as sequence offsets (``PackedRow``) and to Megatron as the block-diagonal causal
mask, with GQA and without, and on other masks; the packed-row paths (offsets, a recognised mask, per-sequence SDPA,
one masked SDPA call, THD cu_seqlens) agree with each other. Through the whole trainer: log-probs, losses and
gradients are the same with and without packing, and with offsets or with dense masks.
"""

import pytest
import torch

from rlfw.model.shape import ModelShape

GQA = ModelShape(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=16,
    max_seq_len=64,
)
MHA = ModelShape(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64, vocab_size=16,
    max_seq_len=64,
)
ATOL = 1e-5


def build_pair(shape):
    from rlfw.megatron.model import build_gpt, transformer_config

    config = transformer_config(shape)
    torch.manual_seed(0)
    reference = build_gpt(shape, config, core_attention="megatron").eval()
    sdpa = build_gpt(shape, config, core_attention="sdpa").eval()
    sdpa.load_state_dict(reference.state_dict())
    return reference, sdpa


def packed_row(lengths, vocab, seed=0):
    """Tokens, restarting positions and the block-diagonal causal mask (True = masked) of one packed row."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    tokens = torch.randint(0, vocab, (1, T), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & (seq_id[:, None] == seq_id[None, :])
    return tokens, positions, (~allowed).view(1, 1, T, T)


def assert_close(a, b, atol=ATOL):
    assert a.shape == b.shape
    diff = (a - b).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"


def test_core_attention_choice(megatron_world):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rlfw.megatron.attention import SDPAttention
    from rlfw.megatron.model import layer_spec

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention

    assert core(layer_spec(GQA, "megatron")) is DotProductAttention
    assert core(layer_spec(GQA, "sdpa")) is SDPAttention
    assert core(layer_spec(GQA)) is SDPAttention  # "auto": SDPA wherever the model runs
    with pytest.raises(ValueError):
        layer_spec(GQA, "flash")


@pytest.mark.parametrize("shape", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("impl", ["auto", "loop", "padded", "mask"])
def test_packed_row_logits_and_grads(megatron_world, shape, impl, monkeypatch):
    from rlfw.megatron import attention

    monkeypatch.setattr(attention, "PACKED_IMPL", impl)
    reference, sdpa = build_pair(shape)
    tokens, positions, mask = packed_row([7, 1, 12, 3, 9], shape.vocab_size)
    outs = []
    for model in (reference, sdpa):
        model.zero_grad()
        logits = model(tokens, positions, mask)
        (logits.float() ** 2).mean().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        outs.append((logits.detach(), grads))
    (ref_logits, ref_grads), (sdpa_logits, sdpa_grads) = outs
    assert_close(sdpa_logits, ref_logits)
    assert ref_grads.keys() == sdpa_grads.keys()
    for k in ref_grads:
        assert_close(sdpa_grads[k], ref_grads[k])


@pytest.mark.parametrize("shape", [GQA, MHA], ids=["gqa", "mha"])
def test_causal_without_mask(megatron_world, shape):
    """No mask + causal mask type (SDPA's is_causal) equals Megatron given the explicit causal mask."""
    reference, sdpa = build_pair(shape)
    tokens, positions, mask = packed_row([24], shape.vocab_size, seed=1)
    with torch.no_grad():
        expected = reference(tokens, positions, mask)
        assert_close(sdpa(tokens, positions, None), expected)
        assert_close(sdpa(tokens, positions, mask), expected)  # a one-sequence row: recognised as plain causal


def test_arbitrary_mask_goes_to_sdpa(megatron_world):
    """A mask that is not block-diagonal causal is passed to SDPA as is (inverted: True = attend there)."""
    from rlfw.megatron.attention import block_causal_segments

    reference, sdpa = build_pair(GQA)
    tokens, positions, _ = packed_row([20], GQA.vocab_size, seed=2)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(20, 20, generator=g) < 0.4
    mask.fill_diagonal_(False)  # every query keeps at least itself
    mask = mask.view(1, 1, 20, 20)
    assert block_causal_segments(mask) is None
    with torch.no_grad():
        assert_close(sdpa(tokens, positions, mask), reference(tokens, positions, mask))


def test_batch_of_two_rows(megatron_world):
    """b = 2 with a per-row mask [2, 1, T, T]: rows with different packings."""
    reference, sdpa = build_pair(GQA)
    t1, p1, m1 = packed_row([5, 11], GQA.vocab_size, seed=4)
    t2, p2, m2 = packed_row([3, 3, 10], GQA.vocab_size, seed=5)
    tokens, positions, mask = torch.cat([t1, t2]), torch.cat([p1, p2]), torch.cat([m1, m2])
    with torch.no_grad():
        assert_close(sdpa(tokens, positions, mask), reference(tokens, positions, mask))


def test_segments_recognised_and_cached(megatron_world):
    from rlfw.megatron.attention import block_causal_segments, packed_cu_seqlens

    _, _, mask = packed_row([4, 1, 6], 16)
    assert block_causal_segments(mask) == [[4, 1, 6]]
    assert block_causal_segments(mask) == [[4, 1, 6]]  # cached
    cu, longest = packed_cu_seqlens(mask, [4, 1, 6], 1, torch.device("cpu"))
    assert cu.tolist() == [0, 4, 5, 11] and cu.dtype == torch.int32 and longest == 6
    assert packed_cu_seqlens(mask, [4, 1, 6], 1, torch.device("cpu"))[0] is cu  # one device tensor for all layers
    mask[0, 0, 8, 6] = True  # an in-place change bumps the version: recomputed, no longer block-diagonal causal
    assert block_causal_segments(mask) is None
    causal = ~torch.ones(9, 9, dtype=torch.bool).tril().view(1, 1, 9, 9)
    assert block_causal_segments(causal) == [[9]]
    full = torch.zeros(1, 1, 9, 9, dtype=torch.bool)  # bidirectional: not causal
    assert block_causal_segments(full) is None


def test_thd_packed_seq_params_matches_block_mask(megatron_world):
    """THD input ([t, heads, dim] + cu_seqlens) gives the same output as the [s, 1, ...] row with the block mask."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from rlfw.megatron.attention import SDPAttention, segments_to_cu_seqlens
    from rlfw.megatron.model import transformer_config

    config = transformer_config(GQA)
    module = SDPAttention(config, 1, AttnMaskType.causal, "self")
    lengths = [6, 2, 9]
    T = sum(lengths)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(T, 1, 4, 8, generator=g)
    k, v = torch.randn(T, 1, 2, 8, generator=g), torch.randn(T, 1, 2, 8, generator=g)
    _, _, mask = packed_row(lengths, 16)
    row = module(q, k, v, mask)
    cu, longest = segments_to_cu_seqlens(lengths)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    thd = module(q[:, 0], k[:, 0], v[:, 0], None, attn_mask_type=AttnMaskType.padding_causal,
                 packed_seq_params=params)
    assert thd.shape == (T, 32)
    assert_close(thd, row[:, 0])


def test_bf16_model_keeps_norm_weights_in_bf16(megatron_world):
    """Megatron's local norms would stay fp32 (torch.rms_norm then cannot fuse with bf16 activations)."""
    from rlfw.megatron.model import build_gpt, transformer_config

    model = build_gpt(GQA, transformer_config(GQA, bf16=True), core_attention="sdpa")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32 = build_gpt(GQA, transformer_config(GQA), core_attention="sdpa")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}


def offsets(lengths):
    from rlfw.megatron.attention import packed_row, segments_to_cu_seqlens

    cu, longest = segments_to_cu_seqlens(lengths)
    return packed_row(cu, longest, sum(lengths))


@pytest.mark.parametrize("shape", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("impl", ["auto", "loop", "padded"])
def test_packed_row_offsets_match_megatron_with_mask(megatron_world, shape, impl, monkeypatch):
    """GPTModel.forward(packed_seq_params=PackedRow) with SDPAttention == Megatron's attention given the dense mask;
    no mask reaches SDPAttention."""
    from rlfw.megatron import attention

    monkeypatch.setattr(attention, "PACKED_IMPL", impl)
    reference, sdpa = build_pair(shape)
    lengths = [7, 1, 12, 3, 9]
    tokens, positions, mask = packed_row(lengths, shape.vocab_size, seed=7)
    outs = []
    for model, kwargs in ((reference, {"attention_mask": mask}),
                          (sdpa, {"attention_mask": None, "packed_seq_params": offsets(lengths)})):
        model.zero_grad()
        logits = model(tokens, positions, **kwargs)
        (logits.float() ** 2).mean().backward()
        outs.append((logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (ref_logits, ref_grads), (logits, grads) = outs
    assert_close(logits, ref_logits)
    for k in ref_grads:
        assert_close(grads[k], ref_grads[k])


def test_packed_row_refuses_batches_and_unknown_formats(megatron_world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from rlfw.megatron.attention import SDPAttention
    from rlfw.megatron.model import transformer_config

    module = SDPAttention(transformer_config(GQA), 1, AttnMaskType.causal, "self")
    q, kv = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8)
    with pytest.raises(NotImplementedError, match="batch size 1"):
        module(q, kv, kv, None, packed_seq_params=offsets([2, 4]))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="qkv_format='bshd'"):
        module(q[:, :1], kv[:, :1], kv[:, :1], None,
               packed_seq_params=PackedSeqParams(qkv_format="bshd", cu_seqlens_q=cu, cu_seqlens_kv=cu))


# ------------------------------------------------------------------------------------- through the trainer
def trainer_batch(lengths, seed=0):
    """A GRPO batch of sequences of ``lengths`` (prompts of 3 tokens) with old log-probs and advantages."""
    import random

    from rlfw.data.batch import DYNAMIC_GBS, RolloutBatch

    rng = random.Random(seed)
    samples = {"sample_id": [], "group_id": [], "tokens": [], "prompt_len": [], "advantage": [], "old_logprobs": []}
    for i, n in enumerate(lengths):
        samples["sample_id"].append(i)
        samples["group_id"].append(i // 2)
        samples["tokens"].append([rng.randrange(GQA.vocab_size) for _ in range(n)])
        samples["prompt_len"].append(3)
        samples["advantage"].append(rng.gauss(0.0, 1.0))
        samples["old_logprobs"].append([-2.5 + rng.gauss(0.0, 0.1) for _ in range(n - 3)])
    batch = RolloutBatch(samples, {"step": 0})
    batch.meta[DYNAMIC_GBS] = {"num_samples": len(batch), "num_tokens": batch.num_response_tokens()}
    return batch


def make_trainer(core_attention, budget):
    from rlfw.config.schema import AlgoConfig
    from rlfw.megatron.policy import PolicyTrainer

    algo = AlgoConfig(name="grpo", max_tokens_per_microbatch=budget)
    return PolicyTrainer(GQA, algo, tp=1, temperature=1.0, device=torch.device("cpu"), init_seed=5,
                         core_attention=core_attention)


def test_trainer_same_with_and_without_packing(megatron_world):
    """Lengths 17-24 under a 24-token budget give one sequence per row; under 128 tokens, rows of several sequences.
    SDPAttention with offsets, packed or not, and Megatron's attention with dense masks: the same log-probs,
    losses and gradients."""
    lengths = [17, 24, 20, 18, 23, 19, 21, 22]
    batch = trainer_batch(lengths)
    runs = {}
    for name, attention, budget in (("offsets packed", "sdpa", 128), ("offsets one per row", "sdpa", 24),
                                    ("mask packed", "megatron", 128)):
        trainer = make_trainer(attention, budget)
        assert trainer.dense_mask == (attention == "megatron")
        logprobs = trainer.logprobs(batch)["old_logprobs"]
        trainer.zero_grad()
        sums = trainer.forward_backward(batch)
        grads = torch.cat([g.clone() for g in trainer.grad_buffers()])
        runs[name] = (logprobs, sums["loss"], grads)
    ref_lp, ref_loss, ref_grads = runs.pop("offsets one per row")
    assert all(len(lp) == n - 3 for lp, n in zip(ref_lp, lengths))
    for name, (logprobs, loss, grads) in runs.items():
        for got, expected in zip(logprobs, ref_lp, strict=True):
            assert_close(torch.tensor(got), torch.tensor(expected))
        assert loss == pytest.approx(ref_loss, abs=ATOL), name
        assert grads.abs().max() > 0
        assert_close(grads, ref_grads)


def test_fused_adam_matches_the_default_step(megatron_world):
    """use_fused_adam switches Megatron's torch AdamW to the fused kernel: same update (to rounding)."""
    from rlfw.megatron.trainer import use_fused_adam

    batch = trainer_batch([17, 24, 20, 18])
    initial = make_trainer("sdpa", 128).named_weights()
    weights = []
    for fused in (False, True):
        trainer = make_trainer("sdpa", 128)
        if fused:
            use_fused_adam(trainer.optimizer)
        groups = [g for part in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
                  for g in part.optimizer.param_groups]
        assert all(bool(g["fused"]) == fused for g in groups)
        for _ in range(2):
            trainer.zero_grad()
            trainer.forward_backward(batch)
            assert trainer.optimizer_step() is not None
        weights.append(trainer.named_weights())
    plain, fused = weights
    assert all(not torch.equal(plain[k], initial[k]) for k in plain)  # every weight moved
    for k in plain:
        assert_close(fused[k], plain[k], atol=1e-6)
