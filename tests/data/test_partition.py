import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfw.data.partition import (
    balanced_partition,
    partition,
    strided_partition,
    workload_cost,
)

# Small integer costs produce many ties; floats cover the general case.
costs_strategy = st.one_of(
    st.lists(st.integers(min_value=0, max_value=5), max_size=60),
    st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=60),
)
k_strategy = st.integers(min_value=1, max_value=20)


def long_tailed_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Response lengths shaped like RL rollouts: most short, a few near the 8192 cap."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.5, sigma=1.0, size=n), 16, 8192).round()


def max_over_mean(costs: np.ndarray, parts: list[list[int]]) -> float:
    sums = np.array([costs[part].sum() for part in parts])
    return sums.max() / sums.mean()


def assert_valid(parts: list[list[int]], n: int, k: int) -> None:
    assert len(parts) == k
    assert sorted(i for part in parts for i in part) == list(range(n))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(part == sorted(part) for part in parts)


@settings(max_examples=60, deadline=None)
@given(costs=costs_strategy, k=k_strategy)
def test_balanced_is_valid_and_deterministic(costs, k):
    parts = balanced_partition(costs, k)
    assert_valid(parts, len(costs), k)
    assert balanced_partition(np.array(costs, dtype=float), k) == parts


@settings(max_examples=30, deadline=None)
@given(n=st.integers(min_value=0, max_value=60), k=k_strategy)
def test_strided_is_valid_and_deals_in_order(n, k):
    parts = strided_partition(n, k)
    assert_valid(parts, n, k)
    assert all(i % k == p for p, part in enumerate(parts) for i in part)


@pytest.mark.parametrize("how", ["strided", "balanced"])
def test_more_parts_than_samples(how):
    parts = partition([3.0, 1.0, 2.0], 5, how)
    assert_valid(parts, 3, 5)
    assert sum(1 for part in parts if not part) == 2


@pytest.mark.parametrize("how", ["strided", "balanced"])
def test_empty_batch(how):
    assert partition([], 3, how) == [[], [], []]


def test_balanced_hand_checked_example():
    # Total 30 over sizes 2 and 3: {8, 7} and {6, 5, 4} split it exactly in half.
    parts = balanced_partition([8, 7, 6, 5, 4], 2)
    assert sorted(parts) == [[0, 1], [2, 3, 4]]


@pytest.mark.parametrize("n", [1024, 1000])
@pytest.mark.parametrize("k", range(2, 17))
def test_balanced_beats_strided_on_long_tailed_lengths(n, k):
    costs = workload_cost(long_tailed_lengths(n))
    balanced = max_over_mean(costs, balanced_partition(costs, k))
    strided = max_over_mean(costs, strided_partition(n, k))
    assert balanced <= 1.01
    assert balanced - 1 <= (strided - 1) / 10


def test_workload_cost_adds_quadratic_attention_term():
    np.testing.assert_allclose(workload_cost([0, 10, 100], attention_weight=0.5), [0, 60, 5100])
    default = workload_cost([1000, 8000])
    assert default[1] / default[0] > 8  # attention makes long samples superlinearly expensive


def test_partition_dispatches():
    costs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert partition(costs, 2, "balanced") == balanced_partition(costs, 2)
    assert partition(costs, 2, "strided") == strided_partition(5, 2)
    assert partition(5, 2, "strided") == strided_partition(5, 2)


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match="sorted_by_length"):
        partition([1.0], 1, "sorted_by_length")


def test_balanced_needs_costs():
    with pytest.raises(TypeError):
        partition(4, 2, "balanced")


@pytest.mark.parametrize("k", [0, -1])
def test_bad_k_is_rejected(k):
    with pytest.raises(ValueError, match="k"):
        balanced_partition([1.0, 2.0], k)
    with pytest.raises(ValueError, match="k"):
        strided_partition(2, k)


@pytest.mark.parametrize("costs", [[1.0, float("nan")], [1.0, -2.0], [float("inf")]])
def test_bad_costs_are_rejected(costs):
    with pytest.raises(ValueError):
        balanced_partition(costs, 2)
