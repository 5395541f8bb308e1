"""Results of one benchmark call: every row goes to ``bench_gpu.jsonl`` as it is measured, tables at the end."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.gpu.model import DATASHEET_BF16, model_flops


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Results:
    def __init__(self, out_dir: Path, rate: float | None = None):
        self.out_dir, self.rate, self.rows = out_dir, rate, []
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_gpu.jsonl").unlink(missing_ok=True)

    def record(self, **row) -> dict:
        self.rows.append(row)
        with open(self.out_dir / "bench_gpu.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        return row

    def timing(self, name: str, shape, lengths, timings: list[dict], **extra) -> dict:
        """Median of every ``*_s`` phase; tokens/s and MFU of the whole step against the measured matmul rate."""
        full, causal = model_flops(shape, lengths)
        med = {k: statistics.median(t[k] for t in timings) for k in timings[0] if k.endswith("_s")}
        step = med["step_s"]
        row = self.record(
            kind="timing", name=name, tokens=sum(lengths), num_seqs=len(lengths), repeats=len(timings), **med,
            spread_s=max(t["step_s"] for t in timings) - min(t["step_s"] for t in timings),
            tokens_per_s=sum(lengths) / step, model_tflops=full / step / 1e12,
            mfu=full / step / self.rate if self.rate else None,
            mfu_causal=causal / step / self.rate if self.rate else None,
            mfu_datasheet=full / step / DATASHEET_BF16,
            peak_mem_gib=max((t[k] for t in timings for k in t if k.endswith("peak_gib")), default=None),
            **{k: max(t[k] for t in timings) for k in timings[0] if k.endswith("_gib")},
            loss=timings[-1].get("loss"), **extra,
        )
        mfu = f", {100 * row['mfu']:.1f}% of the matmul rate" if self.rate else ""
        log(f"{name}: {step * 1e3:.1f} ms, {row['tokens_per_s']:.0f} tok/s{mfu}")
        return row

    def failed(self, name: str, exc: BaseException) -> None:
        self.record(kind="error", name=name, error=repr(exc))
        log(f"{name} FAILED: {exc!r}")

    def table(self) -> str:
        from bench.runner import table

        rows = []
        for r in self.rows:
            if r["kind"] != "timing":
                continue
            rows.append([r["name"], r["tokens"], round(r["step_s"] * 1e3, 1), round(r["fwd_bwd_s"] * 1e3, 1),
                         round(r["reduce_s"] * 1e3, 1), round(r["optim_s"] * 1e3, 1), round(r["spread_s"] * 1e3, 1),
                         round(r["tokens_per_s"]), _percent(r["mfu"]), _percent(r["mfu_causal"]),
                         *(round(r[k], 1) if r.get(k) else "-"
                           for k in ("peak_mem_gib", "rest_gib", "fwd_bwd_peak_gib", "optim_peak_gib"))])
        return table(["run", "tokens", "step ms", "fwd+bwd ms", "reduce ms", "optim ms", "spread ms", "tok/s",
                      "% matmul", "% matmul causal", "GiB", "GiB at rest", "GiB fwd+bwd", "GiB optim"], rows)

    def write_summary(self) -> None:
        (self.out_dir / "bench_gpu.json").write_text(json.dumps(self.rows, indent=1, default=str))


def _percent(fraction: float | None):
    return round(100 * fraction, 1) if fraction is not None else "-"
