"""The local engine on one GPU: its decoders on the same long-tailed requests, side by side, and a weight push
three ways. Prints one table per shape; full rows go to ``--out``/engine.jsonl.

    python3 bench/bench_gpu_engine.py --shapes 0.5b,1.5b --out $OUT

Decoder rows, each on the same 512 requests (64 prompts of 16-128 random tokens x 8 samples, temperature 1,
``--max-new`` tokens at most, seed fixed):
- ``lockstep``: one left-padded batch, HF's DynamicCache (grows by concatenation every token), eager, until the
  longest response ends: what a loop over ``model(...)`` with transformers' defaults gives.
- ``slots eager``: continuous batching over the slot cache, no CUDA graphs.
- ``slots graphs``: the same with each decode step replayed as a CUDA graph (the CUDA default); ``max_batch`` 0
  (every request in a slot from the start; the tail compacted) and ``--refill`` (fewer slots, refilled).
Each slots row runs twice: the first call includes building the cache and capturing the graphs (``first s``).

The workload: random weights, so the lengths are set by the EOS logit alone: the EOS row of the output layer is
``--eos-scale`` x a unit vector on one hidden coordinate that no other token's row uses, so its logit is that
coordinate (about a standard normal after the final norm) times the scale, and a response stops after a
geometric-like number of tokens, capped at ``--max-new``: a long tail. The scale is calibrated first (the largest
of a few that gives a mean length at most ``--mean-len``).

Checks (same call): greedy tokens of ``slots graphs`` against ``slots eager`` and ``lockstep`` (bf16: batch
composition changes the rounding, so the first tokens agree and long ones may part); log-probs of each against one
full forward of prompt + response (|diff| median and max).

Weight push rows (the HF state dict of the shape in bf16 into the engine): from host memory (what the Ray object
store hands an engine today), from the same GPU in the same process, and from another process on the same GPU
through one CUDA IPC handle (``rlfw.model.device_weights``): the time until the engine holds them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu.model import QWEN2_1P5B, TINY  # noqa: E402
from rlfw.rollout.engines.local import LocalEngine  # noqa: E402
from rlfw.rollout.types import SamplingParams  # noqa: E402

# Qwen2's own shapes: biases on q/k/v, tied embeddings (the trainer benchmark's 1.5B row has neither)
SHAPES = {
    "0.5b": replace(QWEN2_1P5B, num_layers=24, hidden_size=896, num_attention_heads=14, head_dim=64,
                    ffn_hidden_size=4864, max_seq_len=2048, qkv_bias=True, tie_word_embeddings=True),
    "1.5b": replace(QWEN2_1P5B, max_seq_len=2048, qkv_bias=True, tie_word_embeddings=True),
    "tiny": TINY,
}
EOS, PAD = 2, 0


def log(msg: str) -> None:
    print(msg, flush=True)


def long_tail_weights(engine: LocalEngine, scale: float) -> dict[str, torch.Tensor]:
    """The engine's random init with the EOS logit tied to hidden coordinate 0 (see the module docstring)."""
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    head = state["lm_head.weight"] if "lm_head.weight" in state else state["model.embed_tokens.weight"]
    head[:, 0] = 0
    head[EOS] = 0
    head[EOS, 0] = scale
    if "lm_head.weight" in state and engine.shape.tie_word_embeddings:
        state["model.embed_tokens.weight"] = head
    return state


def requests(n_prompts: int, samples: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 129, (n_prompts,), generator=g)]
    return [p for p in prompts for _ in range(samples)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(engine: LocalEngine, reqs, params) -> tuple[float, list]:
    sync()
    started = time.perf_counter()
    out = engine.generate(reqs, params)
    sync()
    return time.perf_counter() - started, out


def full_forward_logprobs(engine: LocalEngine, prompt: list[int], gen, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + gen.response_ids], device=engine.device)
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    scaled = logits[len(prompt) - 1:-1] / (temperature or 1.0)
    want = torch.log_softmax(scaled, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
    return (want.cpu() - torch.tensor(gen.logprobs)).abs()


def bench_shape(name: str, args, rows: list[dict]) -> None:
    shape = SHAPES[name]
    dev = args.device
    reqs = requests(args.prompts, args.samples, shape.vocab_size)
    engines = {
        "lockstep": LocalEngine(shape, EOS, PAD, seed=0, device=dev, decoder="lockstep"),
        "slots eager": LocalEngine(shape, EOS, PAD, seed=0, device=dev, decoder="slots", cuda_graphs=False),
        "slots graphs": LocalEngine(shape, EOS, PAD, seed=0, device=dev, decoder="slots"),
        f"slots graphs max_batch={args.refill}": LocalEngine(shape, EOS, PAD, seed=0, device=dev, decoder="slots",
                                                             max_batch=args.refill),
    }
    reference = engines["slots graphs"]
    # calibrate the EOS scale on the graphs engine (short responses are cheap)
    scale = None
    for candidate in args.eos_scales:
        reference.update_weights(long_tail_weights(reference, candidate), 1)
        probe = reference.generate(reqs[:256], SamplingParams(temperature=1.0, max_new_tokens=args.max_new, seed=1))
        mean = statistics.mean(len(g.response_ids) for g in probe)
        log(f"[{name}] eos scale {candidate}: mean length {mean:.0f} of 256 requests")
        scale = candidate
        if mean <= args.mean_len:
            break
    weights = long_tail_weights(reference, scale)
    for engine in engines.values():
        engine.update_weights(weights, 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, seed=7)
    outputs = {}
    for label, engine in engines.items():
        if label == "lockstep" and name not in args.lockstep_shapes:
            continue
        on_cuda = torch.cuda.is_available()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if on_cuda else 0
        first, out = timed(engine, reqs, params)
        second = None
        if "graphs" in label:  # the first call captured the graphs: the second one is the steady state
            second, out = timed(engine, reqs, params)
        peak = torch.cuda.max_memory_allocated() - base if on_cuda else 0
        tokens = sum(len(g.response_ids) for g in out)
        lengths = sorted(len(g.response_ids) for g in out)
        seconds = second if second is not None else first
        row = {"kind": "decode", "shape": name, "decoder": label, "requests": len(reqs), "tokens": tokens,
               "mean_len": tokens / len(out), "p50_len": lengths[len(lengths) // 2], "max_len": lengths[-1],
               "first_s": first, "s": seconds, "tok_s": tokens / seconds, "peak_gib_above_weights": peak / 2**30,
               "eos_scale": scale}
        rows.append(row)
        outputs[label] = out
        log(json.dumps(row))
        if engine is not reference:
            engine.release_memory()
    # checks: greedy agreement and log-probs against a full forward
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    few = reqs[::8][:32]
    want = engines["slots eager"].generate(few, greedy)
    for label in ("slots graphs", "lockstep"):
        got = engines[label].generate(few, greedy)
        same16 = sum(a.response_ids[:16] == b.response_ids[:16] for a, b in zip(got, want))
        same = sum(a.response_ids == b.response_ids for a, b in zip(got, want))
        rows.append({"kind": "check", "shape": name, "what": f"greedy {label} vs slots eager",
                     "first16_equal": f"{same16}/{len(few)}", "all64_equal": f"{same}/{len(few)}"})
        log(json.dumps(rows[-1]))
    for label, out in outputs.items():
        diffs = torch.cat([full_forward_logprobs(reference, reqs[i], out[i], 1.0) for i in range(0, len(reqs), 64)])
        rows.append({"kind": "check", "shape": name, "what": f"logprobs {label} vs full forward",
                     "median_abs": float(diffs.median()), "max_abs": float(diffs.max())})
        log(json.dumps(rows[-1]))
    for label, engine in engines.items():
        engine.release_memory()
    if torch.cuda.is_available():
        bench_push(name, reference, weights, rows)
    del engines, reference
    torch.cuda.empty_cache()


def _writer(state: dict, queue, done) -> None:
    """Another process on the same GPU: its weights go out as one CUDA IPC handle."""
    from rlfw.model.device_weights import pack

    torch.cuda.set_device(0)
    on_gpu = {k: v.to("cuda") for k, v in state.items()}
    for _ in range(3):
        torch.cuda.synchronize()
        sent = time.perf_counter()
        packed = pack(on_gpu)
        torch.cuda.synchronize()
        queue.put((time.time(), time.perf_counter() - sent, packed.share()))
        done.get()  # the engine loaded them: the buffer may go


def bench_push(name: str, engine: LocalEngine, weights: dict, rows: list[dict]) -> None:
    host = {k: v.to(torch.bfloat16).cpu() for k, v in weights.items()}
    gib = sum(v.numel() * v.element_size() for v in host.values()) / 2**30
    for label, state in (("host memory -> GPU", host),
                         ("same GPU, same process", {k: v.cuda() for k, v in host.items()})):
        times = []
        for version in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine.update_weights(state, 10 + version)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        rows.append({"kind": "push", "shape": name, "path": label, "gib": gib, "s": min(times)})
        log(json.dumps(rows[-1]))
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_writer, args=(host, queue, done))
    proc.start()
    times, packing = [], []
    for version in range(3):
        _, pack_s, handle = queue.get(timeout=300)
        started = time.perf_counter()
        engine.update_weights(handle.open().tensors(), 20 + version)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        packing.append(pack_s)
        done.put(True)
    proc.join(60)
    rows.append({"kind": "push", "shape": name, "path": "same GPU, another process (CUDA IPC)", "gib": gib,
                 "s": min(times) + min(packing), "engine_open_load_s": min(times), "writer_pack_s": min(packing)})
    log(json.dumps(rows[-1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/bench"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=1024)
    parser.add_argument("--mean-len", type=float, default=300)
    parser.add_argument("--eos-scales", type=lambda s: [float(x) for x in s.split(",")], default=[4.0, 4.5, 5.0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--refill", type=int, default=128)
    parser.add_argument("--lockstep-shapes", default="0.5b,1.5b")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    rows: list[dict] = [{"kind": "env", "gpu": gpu, "torch": torch.__version__,
                         "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}]
    log(json.dumps(rows[0]))
    for name in args.shapes.split(","):
        try:
            bench_shape(name, args, rows)
        except Exception as e:  # noqa: BLE001  (the other shape still runs; the error is in the table)
            import traceback

            traceback.print_exc()
            rows.append({"kind": "error", "shape": name, "error": f"{type(e).__name__}: {e}"})
        (out / "engine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        if r["kind"] == "decode":
            log(f"| {r['shape']} | {r['decoder']} | {r['tokens']} | {r['mean_len']:.0f} / {r['p50_len']} / "
                f"{r['max_len']} | {r['first_s']:.2f} | {r['s']:.2f} | {r['tok_s']:.0f} | "
                f"{r['peak_gib_above_weights']:.2f} |")
        elif r["kind"] == "push":
            log(f"| {r['shape']} | push: {r['path']} | {r['gib']:.2f} GiB | {r['s']:.3f} s |")
        elif r["kind"] in ("check", "error"):
            log(json.dumps(r))


if __name__ == "__main__":
    main()
