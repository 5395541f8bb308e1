"""The output head, chunked: the sampled tokens' log-probs and the entropy from the last hidden state, without ever
holding the ``[tokens, vocabulary]`` logits.

Materialised, the fp32 logits of a 16k-token micro-batch over a 152k vocabulary are 10 GB, and the unfused path
holds about three such tensors (logits, their softmax, the gradient). Here the tokens go through the head in chunks
of ``chunk_tokens``: the forward keeps per token only log Z and E_p[l] (two floats), the backward recomputes each
chunk's logits and turns them straight into the gradients of the hidden state and of the output weight. The peak
is one chunk's logits, at the price of one more head matmul (the recompute: 4 instead of 3). On CUDA the element-wise
work of a chunk (softmax statistics forward, the logits' gradient backward) is one torch.compile'd kernel each, so
the [chunk, vocab] logits are read once per pass instead of once per operation.

Why our own and not liger-kernel's fused linear cross-entropy or its chunked RL losses: those take the whole output
weight (tensor parallelism would have to all-gather it, 467 MB in bf16 for Qwen2-1.5B, every micro-batch) and
either fold the gradient into the forward, which works only when the loss is a fixed sum of the per-token terms,
or fix the loss formula. rlfw's policy loss (clipping, dual clip, TIS, KL estimators, entropy bonus, its per-token
global weights) is a function of the log-probs, so the head returns log-probs and entropy and takes their gradients
like any autograd op. Each rank works on its vocabulary shard: the softmax statistics are all-reduced over the
tensor-parallel group (three floats per token), the weight is never gathered.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist

from rlfw.megatron.wgrad import add_weight_grad


def emit_hidden_states(gpt, emit: bool = True) -> None:
    """Make ``gpt`` (a megatron-core GPTModel) return its last hidden state, after the final norm, in place of
    the logits: ``[batch, seq, hidden]``, where the logits would have been ``[batch, seq, vocab / tp]``;
    ``emit=False`` gives the model its own output layer back (bare-Megatron baselines, Megatron's LM loss).

    GPTModel has no public switch for this. Its post-processing calls ``self.output_layer(hidden_states,
    weight=..., runtime_gather_output=...)`` and transposes the result to batch-first; replacing that one
    instance's ``forward`` keeps the layer, its weight and every state-dict key as they are (checkpoints and
    weight sync see no difference). ``tests/megatron/test_head.py`` pins the contract against the installed
    megatron-core: hidden state times ``head_weight`` equals the model's own logits.
    """
    layer = gpt.output_layer
    if not emit:
        layer.__dict__.pop("forward", None)
        return

    def hidden_states_out(self, input_, weight=None, runtime_gather_output=None):
        return input_, None

    layer.forward = types.MethodType(hidden_states_out, layer)


def head_weight(gpt) -> torch.Tensor:
    """This rank's shard of the output weight, ``[vocab / tp, hidden]``, as GPTModel hands it to its output layer
    (the input embedding when the two are tied)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                  chunk_tokens: int = 4096, group=None, entropy: bool = False):
    """log softmax(hidden @ weight.T / temperature)[label] per token, and (``entropy``) the full-vocabulary
    entropy of that softmax; ``(logprobs, entropy or None)``, fp32, of ``labels``' shape.

    ``hidden`` [..., H] (any leading shape matching ``labels``); ``weight`` [V / tp, H], this rank's rows of the
    vocabulary in order (rank r holds rows r * V / tp onwards, as Megatron's vocab-parallel layers do); ``group``:
    the tensor-parallel group (None: one rank, the whole vocabulary). A label outside this rank's rows contributes
    nothing here (another rank's shard holds it), as in Megatron's ``vocab_parallel_cross_entropy``.
    Under tensor parallelism the gradient of ``hidden`` is all-reduced over ``group`` (each rank's is a partial
    sum over its vocabulary rows), like Megatron's column-parallel output layer does.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    sharded = group is not None and dist.get_world_size(group) > 1
    if sharded:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    lead = labels.shape
    vocab_start = dist.get_rank(group) * weight.size(0) if sharded else 0
    logprobs, ent = _ChunkedHead.apply(hidden.reshape(-1, hidden.size(-1)), weight, labels.reshape(-1),
                                       float(temperature), int(chunk_tokens), group if sharded else None,
                                       vocab_start, bool(entropy))
    return logprobs.view(lead), (ent.view(lead) if entropy else None)


def _on_device_compiled(fn, dynamic: bool | None = None):
    """``fn`` compiled by torch.compile on CUDA tensors (one fused kernel per chunk instead of a pass over the
    [chunk, vocab] fp32 logits per element-wise op), as is on CPU: the same math, which the CPU tests pin.

    The token count (the first dimension of every tensor argument) is symbolic from the first call on, so chunks of
    any length share one graph; the vocabulary size stays a constant (``dynamic=None``), so a kernel finds each
    element's row by a division by a constant. With ``dynamic=True`` it divided by a runtime value for each of a
    chunk's 600M elements, and the two kernels took twice the device time (BENCHMARKS.md, 2026-12-06)."""
    compiled = None

    @functools.wraps(fn)
    def call(logits, *args):
        nonlocal compiled
        if not logits.is_cuda:
            return fn(logits, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=dynamic)
        for t in (logits, *args):
            if isinstance(t, torch.Tensor) and t.dim():
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(logits, *args)

    return call


@_on_device_compiled
def _chunk_stats(logits, local, in_shard, temperature: float, with_entropy: bool):
    """Per token of one chunk, l = logits / T in fp32 over this rank's vocabulary rows: the row max m,
    sum e^(l - m), l[label] (0 where the label is another rank's) and sum e^(l - m) (l - m)."""
    scaled = logits.float() / temperature
    shift = scaled.amax(dim=-1)
    shifted = scaled - shift[:, None]
    exp = shifted.exp()
    picked = scaled.gather(1, local[:, None])[:, 0] * in_shard
    weighted = (exp * shifted).sum(dim=-1) if with_entropy else torch.zeros_like(shift)
    return shift, exp.sum(dim=-1), picked, weighted


@_on_device_compiled
def _chunk_grad(logits, log_z, mean_logit, grad_lp, grad_ent, local, in_shard, temperature: float,
                with_entropy: bool):
    """d(sum g_lp * logprob + g_ent * entropy) / d logits, in the logits' dtype: with p = softmax(l),
    d logprob / d l = onehot(label) - p and d entropy / d l = -p (l - E_p[l]); then / T for l = logits / T."""
    scaled = logits.float() / temperature
    probs = (scaled - log_z[:, None]).exp()
    coef = -grad_lp[:, None]
    if with_entropy:
        coef = coef - grad_ent[:, None] * (scaled - mean_logit[:, None])
    cols = torch.arange(scaled.size(1), device=scaled.device)
    onehot = (cols[None, :] == local[:, None]) & in_shard[:, None]
    grad = probs * coef + onehot * grad_lp[:, None]
    return (grad / temperature).to(logits.dtype)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens, group, vocab_start, with_entropy):
        tokens, shard = hidden.size(0), weight.size(0)
        log_z = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        target = torch.empty_like(log_z)
        mean_logit = torch.empty_like(log_z)
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < shard)
        local = torch.where(in_shard, local, torch.zeros_like(local))
        for lo in range(0, tokens, chunk_tokens):
            hi = min(lo + chunk_tokens, tokens)
            shift, total, picked, weighted = _chunk_stats(hidden[lo:hi] @ weight.t(), local[lo:hi],
                                                          in_shard[lo:hi], temperature, with_entropy)
            if group is not None:
                # Each rank's sums are relative to its own max; rescaled to the global max M they add up:
                # sum e^(l - M) = e^(m - M) sum e^(l - m), sum e^(l - M)(l - M) = e^(m - M) (w + (m - M) s).
                top = shift.clone()
                dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
                scale = (shift - top).exp()
                parts = torch.stack([total * scale, picked, (weighted + (shift - top) * total) * scale])
                dist.all_reduce(parts, group=group)
                shift, (total, picked, weighted) = top, parts
            log_z[lo:hi] = shift + total.log()
            target[lo:hi] = picked
            mean_logit[lo:hi] = shift + weighted / total  # E_p[l]
        logprobs = target - log_z
        entropy = log_z - mean_logit if with_entropy else torch.empty(0, device=hidden.device)
        ctx.save_for_backward(hidden, weight, local, in_shard, log_z, mean_logit)
        ctx.temperature, ctx.chunk_tokens, ctx.with_entropy = temperature, chunk_tokens, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local, in_shard, log_z, mean_logit = ctx.saved_tensors
        if grad_logprobs is None:  # only the entropy is used
            grad_logprobs = torch.zeros_like(log_z)
        with_entropy = ctx.with_entropy and grad_entropy is not None
        if not with_entropy:
            grad_entropy = log_z  # unread
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 accumulation over the chunks; the gradient is handed back in the weight's dtype
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for lo in range(0, hidden.size(0), ctx.chunk_tokens):
            hi = min(lo + ctx.chunk_tokens, hidden.size(0))
            grad = _chunk_grad(hidden[lo:hi] @ weight.t(), log_z[lo:hi], mean_logit[lo:hi], grad_logprobs[lo:hi],
                               grad_entropy[lo:hi], local[lo:hi], in_shard[lo:hi], ctx.temperature, with_entropy)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = grad @ weight
            if grad_weight is not None:
                add_weight_grad(hidden[lo:hi], grad, grad_weight)  # fp32 sum, inside the GEMM on CUDA
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None
