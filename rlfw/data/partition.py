"""Divide a batch of samples among data-parallel replicas.

Every replica waits for the slowest one at the gradient all-reduce, so a step takes as long as the most
expensive part. With long-tailed response lengths, dealing samples out in order (``strided``) leaves some
replicas with several long sequences and others idle; ``balanced`` evens out the estimated cost while keeping
the number of samples per replica equal (to within one), so per-replica micro-batch counts stay aligned.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence

import numpy as np

# Per token and layer, the dense matmuls cost ~24*h^2 FLOPs and attention over a length-L sequence ~4*h*L, so
# sample cost is proportional to L + L^2 / (6*h). h = 4096 (a 7B-class model) gives this weight.
DEFAULT_ATTENTION_WEIGHT = 1.0 / (6 * 4096)

# Swap-refinement rounds per part: enough to fix KK's last few percent, bounded so it stays cheap.
_REFINE_ROUNDS_PER_PART = 4

PARTITION_METHODS = ("strided", "balanced")


def workload_cost(lengths, attention_weight: float = DEFAULT_ATTENTION_WEIGHT) -> np.ndarray:
    """Estimate each sample's training cost as ``len + attention_weight * len**2``.

    The linear term is the dense layers (proportional to token count); the quadratic term is attention.
    Only ratios between samples matter, so the unit is "one token of dense compute".
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths + attention_weight * lengths**2


def strided_partition(n: int, k: int) -> list[list[int]]:
    """Deal sample ``i`` to part ``i % k``: cost-blind, but needs no costs and keeps sizes within one."""
    n = operator.index(n)
    k = _check_k(k)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [list(range(part, n, k)) for part in range(k)]


def balanced_partition(costs: Sequence[float], k: int) -> list[list[int]]:
    """Split samples into ``k`` parts whose sizes differ by at most one, keeping the largest part cost low.

    Uses Karmarkar–Karp largest differencing with equal cardinality: samples sorted by cost are cut into
    groups of ``k``, each group a k-tuple of one-sample parts. The two tuples with the largest spread
    (heaviest minus lightest part) are merged by pairing the heaviest parts of one with the lightest of the
    other, until one tuple remains. Padding with zero-cost dummies makes every group full, so any ``n`` works;
    the dummies all fall in the last group, one per part, so dropping them keeps sizes within one.
    A short pass of size-preserving swaps then trims the heaviest part.

    Deterministic: ties are broken by sample index. Each part's indices are sorted ascending.
    """
    k = _check_k(k)
    cost = _check_costs(costs)
    n = len(cost)
    if n == 0:
        return [[] for _ in range(k)]
    if k == 1:
        return [list(range(n))]

    num_groups = -(-n // k)
    padded = np.zeros(num_groups * k)
    padded[:n] = cost
    # Stable sort on -cost: heaviest first, ties (including dummies, which come last) in index order.
    groups = np.argsort(-padded, kind="stable").reshape(num_groups, k)
    group_costs = padded[groups]

    # A tuple is (part sums ascending, part members aligned with them). The heap key is
    # (-spread, creation order) so the widest tuples merge first and ties resolve deterministically.
    heap = []
    for order, (members, sums) in enumerate(zip(groups[:, ::-1].tolist(), group_costs[:, ::-1].tolist())):
        heap.append((sums[0] - sums[-1], order, sums, [[m] for m in members]))
    heapq.heapify(heap)
    next_order = num_groups
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        sums, members = _merge_tuples(sums_a, members_a, sums_b, members_b)
        heapq.heappush(heap, (sums[0] - sums[-1], next_order, sums, members))
        next_order += 1

    parts = [np.array([i for i in part if i < n], dtype=np.int64) for part in heap[0][3]]
    _refine_by_swaps(parts, cost)
    return [sorted(part.tolist()) for part in parts]


def partition(costs_or_n, k: int, how: str) -> list[list[int]]:
    """Partition with the named method: ``"strided"`` takes a sample count or costs, ``"balanced"`` needs costs."""
    if how == "strided":
        n = costs_or_n if isinstance(costs_or_n, (int, np.integer)) else len(costs_or_n)
        return strided_partition(n, k)
    if how == "balanced":
        if isinstance(costs_or_n, (int, np.integer)):
            raise TypeError("balanced partitioning needs per-sample costs, not a sample count")
        return balanced_partition(costs_or_n, k)
    raise ValueError(f"unknown partition method how={how!r}; expected one of {PARTITION_METHODS}")


def _merge_tuples(sums_a, members_a, sums_b, members_b):
    """Pair the i-th lightest part of one tuple with the i-th heaviest of the other; return sorted by sum.

    Parts within a tuple all hold the same number of samples, so the part lists of the tuple with more
    samples are extended in place (smaller into larger keeps total copying at O(n log n)).
    """
    if len(members_a[0]) < len(members_b[0]):
        sums_a, members_a, sums_b, members_b = sums_b, members_b, sums_a, members_a
    merged_sums = [s + t for s, t in zip(sums_a, reversed(sums_b))]
    for part, extra in zip(members_a, reversed(members_b)):
        part.extend(extra)
    order = sorted(range(len(merged_sums)), key=merged_sums.__getitem__)
    return [merged_sums[i] for i in order], [members_a[i] for i in order]


def _refine_by_swaps(parts: list[np.ndarray], cost: np.ndarray) -> None:
    """Swap one sample between the heaviest part and a lighter one while that lowers the heaviest part.

    For a cost gap ``g`` between the two parts, swapping samples ``x`` out and ``y`` in helps when
    ``0 < x - y < g``, and helps most when ``x - y`` is near ``g / 2``. Sizes are unchanged.
    """
    sums = np.array([cost[part].sum() for part in parts])
    for _ in range(_REFINE_ROUNDS_PER_PART * len(parts)):
        heavy = int(np.argmax(sums))
        for light in np.argsort(sums, kind="stable"):
            gap = sums[heavy] - sums[light]
            if gap <= 0:  # reached parts as heavy as the heaviest (at the latest, itself): no swap helps
                return
            swap = _best_swap(cost[parts[heavy]], cost[parts[light]], gap)
            if swap is not None:
                i, j = swap
                delta = cost[parts[heavy][i]] - cost[parts[light][j]]
                parts[heavy][i], parts[light][j] = parts[light][j], parts[heavy][i]
                sums[heavy] -= delta
                sums[light] += delta
                break


def _best_swap(heavy_costs: np.ndarray, light_costs: np.ndarray, gap: float) -> tuple[int, int] | None:
    """Positions ``(i, j)`` whose swap brings the two parts' sums closest together, or None if no swap helps."""
    if len(heavy_costs) == 0 or len(light_costs) == 0:
        return None
    light_order = np.argsort(light_costs, kind="stable")
    light_sorted = light_costs[light_order]
    # For each heavy sample, the light samples just below and above the ideal partner cost x - gap/2.
    upper = np.searchsorted(light_sorted, heavy_costs - gap / 2).clip(max=len(light_sorted) - 1)
    lower = (upper - 1).clip(min=0)
    candidates = np.stack([lower, upper])
    delta = heavy_costs[None, :] - light_sorted[candidates]
    # Exact float comparisons with a relative margin so rounding cannot cause an endless swap cycle.
    useful = (delta > gap * 1e-9) & (delta < gap * (1 - 1e-9))
    if not useful.any():
        return None
    badness = np.where(useful, np.abs(delta - gap / 2), np.inf)
    row, i = np.unravel_index(int(np.argmin(badness)), badness.shape)
    return int(i), int(light_order[candidates[row, i]])


def _check_k(k: int) -> int:
    k = operator.index(k)
    if k < 1:
        raise ValueError(f"k (number of parts) must be >= 1, got {k}")
    return k


def _check_costs(costs: Sequence[float]) -> np.ndarray:
    cost = np.asarray(costs, dtype=np.float64)
    if cost.ndim != 1:
        raise ValueError(f"costs must be one-dimensional, got shape {cost.shape}")
    if not np.isfinite(cost).all():
        raise ValueError("costs must be finite (found NaN or inf)")
    if (cost < 0).any():
        raise ValueError("costs must be non-negative")
    return cost
