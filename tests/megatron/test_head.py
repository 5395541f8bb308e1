"""The chunked output head against the unfused math it replaces (materialised logits, log_softmax, the textbook
entropy), and the one megatron-core contract it relies on (``emit_hidden_states``).

Tensor parallelism (TP=2 shards equal to the whole vocabulary, and a whole trainer step equal under TP=2 and TP=1)
is in ``tests/algo/test_megatron_terms.py``; bf16 on the GPU in ``tests/gpu/test_head_bf16.py``.
"""

import math

import pytest
import torch

from rlfw.algo.losses import policy_loss
from rlfw.config.schema import AlgoConfig
from rlfw.megatron.head import emit_hidden_states, head_logprobs, head_weight

TOKENS, HIDDEN, VOCAB = 13, 8, 37


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.7
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    return hidden, weight, labels


def unfused(hidden, weight, labels, temperature):
    """What the trainer computed before: the whole [tokens, vocab] logits, then log-softmax and entropy."""
    logits = hidden @ weight.t() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def leaves(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("chunk", [1, 4, 13, 100])  # one token, uneven chunks, exactly one chunk, more than all
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_their_gradients_equal_the_unfused_math(chunk, temperature):
    hidden, weight, labels = inputs()
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(TOKENS, generator=g, dtype=torch.float64), torch.randn(TOKENS, generator=g,
                                                                                       dtype=torch.float64)
    h1, w1 = leaves(hidden, weight)
    lp, ent = head_logprobs(h1, w1, labels, temperature, chunk_tokens=chunk, entropy=True)
    ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
    h2, w2 = leaves(hidden, weight)
    lp_ref, ent_ref = unfused(h2, w2, labels, temperature)
    ((lp_ref * up_lp).sum() + (ent_ref * up_ent).sum()).backward()
    # fp32 statistics inside the head: equal to fp64 math within fp32 round-off
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_without_entropy_only_the_logprobs_and_their_gradient():
    hidden, weight, labels = inputs(2)
    h1, w1 = leaves(hidden, weight)
    lp, ent = head_logprobs(h1, w1, labels, chunk_tokens=5)
    assert ent is None
    lp.sum().backward()
    h2, w2 = leaves(hidden, weight)
    unfused(h2, w2, labels, 1.0)[0].sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_the_policy_loss_and_its_gradients_equal_the_unfused_path():
    """Every loss term on (clip, dual clip, TIS, KL, entropy bonus): the loss, its diagnostics and the gradients of
    the hidden state and the output weight, through the chunked head and through the materialised logits."""
    hidden, weight, labels = inputs(3)
    hidden, weight = hidden.float(), weight.float()
    g = torch.Generator().manual_seed(4)
    algo = AlgoConfig(name="grpo", clip_eps_high=0.28, dual_clip_c=3.0, kl_loss_coef=0.1, tis_cap=2.0,
                      entropy_coef=0.05)
    with torch.no_grad():
        base = unfused(hidden, weight, labels, 0.8)[0]
    old = base + 0.3 * torch.randn(TOKENS, generator=g)
    ref = base + 0.3 * torch.randn(TOKENS, generator=g)
    rollout = old + 0.3 * torch.randn(TOKENS, generator=g)
    advantages = torch.randn(TOKENS, generator=g)
    weights = torch.rand(TOKENS, generator=g) * (torch.arange(TOKENS) % 4 != 0)  # some tokens carry no loss

    def run(head):
        h, w = leaves(hidden, weight)
        lp, ent = head(h, w)
        loss, stats = policy_loss(lp, old, advantages, weights, algo, ref, rollout, ent)
        loss.backward()
        return loss.detach(), stats, h.grad, w.grad

    ours = run(lambda h, w: head_logprobs(h, w, labels, 0.8, chunk_tokens=3, entropy=True))
    theirs = run(lambda h, w: unfused(h, w, labels, 0.8))
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    for key in ("pg_loss", "kl", "entropy", "tis_weight", "clip_frac", "dual_clip_frac", "ratio"):
        torch.testing.assert_close(ours[1][key], theirs[1][key], rtol=1e-5, atol=1e-6)
    assert 0 < ours[1]["clip_frac"] and ours[1]["entropy"] > 0
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ours[3], theirs[3], rtol=1e-4, atol=1e-6)


def test_entropy_of_a_two_token_vocabulary_by_hand():
    # uniform: log 2; logits 0, log 3 -> p = 1/4, 3/4 -> -(1/4 log 1/4 + 3/4 log 3/4) = 0.562335
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [50.0, 50.0 + math.log(3.0)]])  # a shift: the same
    lp, ent = head_logprobs(logits, torch.eye(2), torch.tensor([0, 1, 0]), chunk_tokens=2, entropy=True)
    by_hand = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([math.log(2.0), by_hand, by_hand]), rtol=0, atol=1e-6)
    torch.testing.assert_close(lp, torch.tensor([math.log(0.5), math.log(0.75), math.log(0.25)]), rtol=0, atol=1e-6)


def test_extreme_logits_stay_finite():
    """Logits of +-1e4 (a collapsed policy): the shift by the row max keeps exp() in range."""
    hidden, weight, labels = inputs(5)
    lp, ent = head_logprobs(hidden * 3e3, weight, labels, chunk_tokens=4, entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and (lp <= 0).all() and (ent >= -1e-6).all()


def test_a_chunk_budget_below_one_is_refused():
    hidden, weight, labels = inputs()
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_logprobs(hidden, weight, labels, chunk_tokens=0)


@pytest.mark.parametrize("tied", [False, True])
def test_emit_hidden_states_keeps_the_model_and_its_logits(megatron_world, tied):
    """The megatron-core contract: with the output layer replaced by the identity the model returns the final
    norm's output, batch-first; times ``head_weight`` (the embedding when tied) it is the model's own logits, and
    the state dict keeps its keys."""
    from rlfw.megatron.model import build_gpt, transformer_config
    from rlfw.model.shape import ModelShape

    shape = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       vocab_size=24, max_seq_len=16, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = build_gpt(shape, transformer_config(shape, tp=1))
    tokens = torch.randint(0, shape.vocab_size, (1, 10))
    positions = torch.arange(10)[None]
    mask = torch.tril(torch.ones(1, 1, 10, 10)) < 0.5
    keys = set(model.state_dict())
    with torch.no_grad():
        logits = model(tokens, positions, mask)
        emit_hidden_states(model)
        hidden = model(tokens, positions, mask)
    assert logits.shape == (1, 10, shape.vocab_size) and hidden.shape == (1, 10, shape.hidden_size)
    torch.testing.assert_close(hidden @ head_weight(model).t(), logits, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == keys
    emit_hidden_states(model, emit=False)  # the output layer back: the model's own logits again
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions, mask), logits, rtol=0, atol=0)
    assert (head_weight(model) is model.embedding.word_embeddings.weight) == tied

