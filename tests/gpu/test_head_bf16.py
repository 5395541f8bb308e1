"""The chunked output head in bf16 on the GPU (run on the device: BENCHMARKS.md says when and where), against the
materialised bf16 logits it replaces and fp32 math on the same inputs. CPU runs skip it; the same math in fp32 is
pinned in CI by ``tests/megatron/test_head.py``."""

import pytest
import torch

from rlfw.algo.losses import policy_loss
from rlfw.config.schema import AlgoConfig
from rlfw.megatron.head import head_logprobs


def unfused(hidden, weight, labels, temperature):
    logits = hidden @ weight.t() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on the GPU: run on the device (BENCHMARKS.md)")
def test_bf16_on_the_gpu_is_as_close_to_fp32_math_as_the_materialised_head():
    """The Qwen2-1.5B head (hidden 1536, vocab 151,936), bf16 weights and activations, every loss term: log-probs,
    entropy, loss and both gradients from the chunked head are as close to fp32 math on the same bf16 inputs as the
    materialised bf16 logits the trainer used before (which differ from fp32 by bf16 round-off alone)."""
    device, tokens, hidden_size, vocab = torch.device("cuda"), 4096, 1536, 151936
    g = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(tokens, hidden_size, generator=g, device=device) * 0.5).bfloat16()
    weight = (torch.randn(vocab, hidden_size, generator=g, device=device) * 0.02).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    algo = AlgoConfig(name="grpo", clip_eps_high=0.28, dual_clip_c=3.0, kl_loss_coef=0.1, tis_cap=2.0,
                      entropy_coef=0.01)
    with torch.no_grad():
        base = unfused(hidden.float(), weight.float(), labels, 1.0)[0]
    old, ref = base + 0.1 * torch.randn_like(base), base + 0.1 * torch.randn_like(base)
    rollout, advantages = old + 0.1 * torch.randn_like(base), torch.randn_like(base)
    weights = torch.rand_like(base) / tokens

    def run(head, dtype):
        h, w = hidden.to(dtype).clone().requires_grad_(True), weight.to(dtype).clone().requires_grad_(True)
        lp, ent = head(h, w)
        loss, _ = policy_loss(lp.float(), old, advantages, weights, algo, ref, rollout, ent.float())
        loss.backward()
        return [x.detach().float() for x in (lp, ent, loss, h.grad, w.grad)]

    def materialised(h, w):
        logp = torch.log_softmax((h @ w.t()).float(), dim=-1)
        return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    fp32 = run(materialised, torch.float32)
    before = run(materialised, torch.bfloat16)
    ours = run(lambda h, w: head_logprobs(h, w, labels, chunk_tokens=1024, entropy=True), torch.bfloat16)
    for name, a, b, r in zip(("logprobs", "entropy", "loss", "hidden grad", "weight grad"), ours, before, fp32):
        err_ours, err_before = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        assert err_ours <= 1.5 * err_before + 1e-4, (name, err_ours, err_before)
