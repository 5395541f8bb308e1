"""The output head alone, before and after: forward + backward of the sampled tokens' log-probs from the last hidden
state, at several token counts, with the benchmark's vocabulary and hidden size (bf16 weights and activations).

- ``materialised`` (before): the output layer's matmul, the fp32 logits (a copy: Megatron's
  ``vocab_parallel_cross_entropy`` overwrites its input) and that cross-entropy, as the trainer computed it;
- ``chunked <n>`` (rlfw now): ``rlfw.megatron.head.head_logprobs`` with ``n`` tokens per chunk; ``compiled as
  before``: its kernels compiled with every size symbolic, the weight gradient's bf16 products added (``as_before``);
- ``liger fused linear CE`` (peer library, where liger-kernel is installed): its fused linear cross-entropy, which
  folds the gradient into the forward and so takes only a scalar loss (``reduction="sum"`` here; rlfw's loss needs
  per-token log-probs with their own gradients, see the module docstring of ``rlfw.megatron.head``).

Per row: median time of fwd + bwd, the peak memory above the inputs (hidden, weight, labels and their gradients
excluded), and the log-probs' largest difference from fp32 math on the same bf16 inputs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import types

import torch

from rlfw.megatron.head import head_logprobs


def materialised(hidden, weight, labels):
    from megatron.core import tensor_parallel

    logits = (hidden @ weight.t()).float()  # the bf16 output layer, then the fp32 copy the trainer made
    return -tensor_parallel.vocab_parallel_cross_entropy(logits[None], labels[None])[0]


@contextlib.contextmanager
def as_before():
    """The chunked head as it was before its kernels kept the vocabulary size constant (``dynamic=True``) and before
    the output weight's gradient was summed in fp32 inside the GEMM (a bf16 product added to the fp32 sum)."""
    from rlfw.megatron import head

    saved = head._chunk_stats, head._chunk_grad, head.add_weight_grad
    head._chunk_stats = head._on_device_compiled(_fresh_copy(saved[0].__wrapped__), dynamic=True)
    head._chunk_grad = head._on_device_compiled(_fresh_copy(saved[1].__wrapped__), dynamic=True)
    head.add_weight_grad = lambda inp, grad_out, total: total.add_(grad_out.t() @ inp)
    try:
        yield
    finally:
        head._chunk_stats, head._chunk_grad, head.add_weight_grad = saved


def _fresh_copy(fn):
    """``fn`` with a code object of its own: torch.compile keeps its compiled graphs on the code object, so a copy
    compiled with other options neither reuses nor leaves graphs for the original."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_before")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def chunked(chunk: int):
    return lambda hidden, weight, labels: head_logprobs(hidden, weight, labels, chunk_tokens=chunk)[0]


def liger_sum():
    """liger-kernel's fused linear cross-entropy (sum of -log-probs), or None when it is not installed."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None

    def loss(hidden, weight, labels, reduction="sum"):
        out = liger_fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
        return out[0] if isinstance(out, tuple) else out

    return loss


def fp32_logprobs(hidden, weight, labels, chunk: int = 2048) -> torch.Tensor:
    out = []
    for lo in range(0, hidden.size(0), chunk):
        logits = hidden[lo:lo + chunk].float() @ weight.float().t()
        out.append(torch.log_softmax(logits, -1).gather(-1, labels[lo:lo + chunk, None])[:, 0])
    return torch.cat(out)


def measure(tokens_list, hidden_size: int, vocab: int, device, repeats: int = 3) -> list[dict]:
    rows = []
    variants = [("materialised (before)", materialised, False), ("chunked 1024", chunked(1024), False),
                ("chunked 4096", chunked(4096), False), ("chunked 8192", chunked(8192), False),
                ("chunked 4096, compiled as before", chunked(4096), False)]
    peer = liger_sum()
    if peer is not None:
        variants.append(("liger fused linear CE (peer, scalar loss)", peer, True))
    g = torch.Generator(device=device).manual_seed(0)
    for tokens in tokens_list:
        hidden = (torch.randn(tokens, hidden_size, generator=g, device=device) * 0.5).bfloat16().requires_grad_(True)
        weight = (torch.randn(vocab, hidden_size, generator=g, device=device) * 0.02).bfloat16().requires_grad_(True)
        labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
        upstream = torch.randn(tokens, generator=g, device=device)
        with torch.no_grad():
            reference = fp32_logprobs(hidden, weight, labels)
        for name, fn, scalar in variants:
            def reset():
                hidden.grad = weight.grad = None

            def step():
                reset()
                out = fn(hidden, weight, labels)
                (out if scalar else (out * upstream).sum()).backward()

            try:
                with as_before() if "as before" in name else contextlib.nullcontext():
                    row = _time(step, reset, repeats)
                with torch.no_grad():
                    lp = -fn(hidden, weight, labels, reduction="none") if scalar else fn(hidden, weight, labels)
                err = (lp.float() - reference).abs().max().item()
                grads = hidden.numel() * 2 + weight.numel() * 2  # the gradients themselves are not the head's cost
                rows.append({"kind": "head", "name": name, "tokens": tokens, "ms": row["ms"],
                             "extra_gib": (row["extra_bytes"] - grads) / 2**30, "logprob_max_err_vs_fp32": err})
            except Exception as exc:  # noqa: BLE001  (out of memory at a large count: the row says so)
                rows.append({"kind": "head", "name": name, "tokens": tokens, "error": repr(exc)[:200]})
            hidden.grad = weight.grad = None
            torch.cuda.empty_cache()
        del hidden, weight, labels, upstream, reference
        torch.cuda.empty_cache()
    return rows


def _time(step, reset, repeats: int) -> dict:
    """Median milliseconds of ``step`` after a warm-up, and its peak memory above what was allocated before it
    (``reset`` drops the gradients it left)."""
    step()  # warm-up (allocations; Triton compiles here)
    reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"ms": 1e3 * statistics.median(times), "extra_bytes": torch.cuda.max_memory_allocated() - base}


def table(rows: list[dict]) -> str:
    from bench.runner import table as fmt

    return fmt(["head", "tokens", "fwd+bwd ms", "extra GiB", "max |lp - fp32|"],
               [[r["name"], r["tokens"], round(r["ms"], 1), round(r["extra_gib"], 2),
                 f"{r['logprob_max_err_vs_fp32']:.2e}"] if "error" not in r else
                [r["name"], r["tokens"], "failed", r["error"][:60], "-"] for r in rows])
