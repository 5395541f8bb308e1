"""Benchmark rlfw's data-parallel partitioning against strided dealing and verl's balancer.

Balance is max/mean of per-part ``workload_cost`` (1.0 is perfect; the slowest replica sets the step time).
Lengths are seeded and long-tailed like RL rollouts; both balancers are given the same ``workload_cost``
values. Prints a table and writes JSON.

    PYTHONPATH=. python bench/bench_partition.py [--quick] [--out outputs/bench/partition.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from rlfw.data.partition import balanced_partition, strided_partition, workload_cost

REPO_ROOT = Path(__file__).resolve().parent.parent
# 1001 is odd, so no k here divides it: the equal-size case verl rejects and rlfw handles.
SIZES = (1024, 8192, 1001)
PART_COUNTS = (2, 4, 8, 16)
SEED = 0

try:
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions
except ImportError:
    get_seqlen_balanced_partitions = None


def long_tailed_lengths(n: int, seed: int) -> np.ndarray:
    """Lognormal lengths clipped to 16..8192 tokens (median ~665, a few at the cap)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.5, sigma=1.0, size=n), 16, 8192).round()


def max_over_mean(costs: np.ndarray, parts: list[list[int]]) -> float:
    sums = np.array([costs[part].sum() for part in parts])
    return float(sums.max() / sums.mean())


def timed(fn, repeats: int) -> tuple[list[list[int]], float]:
    """Run ``fn`` ``repeats`` times; return its result and the median wall time in ms."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def verl_columns(costs: np.ndarray, k: int, repeats: int) -> dict:
    """verl's balance and time, or a note saying why it was not run."""
    if get_seqlen_balanced_partitions is None:
        return {"verl_max_over_mean": "verl not installed", "verl_ms": "verl not installed"}
    if len(costs) % k:  # equal_size=True asserts divisibility
        return {"verl_max_over_mean": "n/a", "verl_ms": "n/a"}
    cost_list = costs.tolist()
    parts, ms = timed(lambda: get_seqlen_balanced_partitions(cost_list, k, equal_size=True), repeats)
    return {"verl_max_over_mean": max_over_mean(costs, parts), "verl_ms": ms}


def run(repeats: int) -> list[dict]:
    rows = []
    for n in SIZES:
        costs = workload_cost(long_tailed_lengths(n, SEED))
        for k in PART_COUNTS:
            parts, ms = timed(lambda: balanced_partition(costs, k), repeats)
            rows.append(
                {
                    "n": n,
                    "k": k,
                    "strided_max_over_mean": max_over_mean(costs, strided_partition(n, k)),
                    "rlfw_max_over_mean": max_over_mean(costs, parts),
                    "rlfw_ms": ms,
                    **verl_columns(costs, k, repeats),
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    columns = [
        ("n", "n", "{}"),
        ("k", "k", "{}"),
        ("strided_max_over_mean", "strided max/mean", "{:.4f}"),
        ("rlfw_max_over_mean", "rlfw max/mean", "{:.6f}"),
        ("rlfw_ms", "rlfw ms", "{:.2f}"),
        ("verl_max_over_mean", "verl max/mean", "{:.6f}"),
        ("verl_ms", "verl ms", "{:.2f}"),
    ]

    def cell(value, fmt):
        return value if isinstance(value, str) else fmt.format(value)

    body = [[cell(row[key], fmt) for key, _, fmt in columns] for row in rows]
    header = [title for _, title, _ in columns]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(columns))]
    lines = [" | ".join(text.rjust(width) for text, width in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 timing repeats instead of 9")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "bench" / "partition.json")
    args = parser.parse_args()

    repeats = 3 if args.quick else 9
    rows = run(repeats)
    print(format_table(rows))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "seed": SEED,
        "repeats": repeats,
        "lengths": "lognormal(6.5, 1.0) clipped to 16..8192",
        "cost": "workload_cost (len + attention_weight * len**2)",
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
