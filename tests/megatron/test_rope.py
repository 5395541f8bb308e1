"""rlfw's fused RoPE (``rlfw.megatron.rope``): the same math as Megatron's unfused RoPE, and really reached through
Megatron's private ``fused_apply_rotary_pos_emb`` hook when ``apply_rope_fusion`` is set. The compiled kernel in
bf16 on CUDA is pinned in ``tests/gpu/test_rope_bf16.py``."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from rlfw.megatron import rope
from rlfw.megatron.model import build_gpt, transformer_config
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=24, max_seq_len=16)


def angles(seq: int, rot: int) -> torch.Tensor:
    """Megatron's RotaryEmbedding layout: [seq, 1, 1, rot], the two halves' angles equal (non-interleaved)."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("rot", [16, 8])  # whole heads, and a rotary part with the rest passed through
def test_the_formula_is_megatrons_unfused_rope(rot):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(11, 2, 3, 16, generator=g, requires_grad=True)
    freqs = angles(11, rot)
    upstream = torch.randn(11, 2, 3, 16, generator=g)
    ours = rope.rope_reference(t, freqs)
    (grad_ours,) = torch.autograd.grad((ours * upstream).sum(), t)
    theirs = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    (grad_theirs,) = torch.autograd.grad((theirs * upstream).sum(), t)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=0, atol=1e-6)
    assert torch.equal(ours[..., rot:], t[..., rot:])  # the part without rotary passes unchanged


def test_megatron_attention_reaches_it_through_apply_rope_fusion(megatron_world, monkeypatch):
    """The hook is megatron-core's private module global: if Megatron stops reading it, or reads it with another
    signature, the call count or the logits below change."""
    calls = []

    def counted(t, cos, sin):
        calls.append(tuple(t.shape))
        return rope.rotate(t, cos, sin)

    monkeypatch.setattr(rope, "_compiled", counted)  # eager on CPU: torch.compile's CPU backend is not the point
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert rope.install() and rope_utils.fused_apply_rotary_pos_emb is rope.rope

    def logits(fused: bool) -> torch.Tensor:
        torch.manual_seed(0)
        config = transformer_config(SHAPE)
        config.apply_rope_fusion = fused  # off on CPU by default; attention reads it at every forward
        model = build_gpt(SHAPE, config).eval()
        tokens = torch.randint(0, SHAPE.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
        mask = torch.tril(torch.ones(1, 1, 12, 12)) < 0.5
        with torch.no_grad():
            return model(tokens, torch.arange(12)[None], mask)

    unfused = logits(False)
    assert calls == []
    fused = logits(True)
    assert len(calls) == 2 * SHAPE.num_layers  # queries and keys of every layer
    torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-5)


def test_interleaved_rotary_is_refused():
    with pytest.raises(NotImplementedError, match="non-interleaved"):
        rope.rope(torch.zeros(2, 1, 1, 4), angles(2, 4), interleaved=True)
