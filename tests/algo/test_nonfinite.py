"""What a NaN or inf does to a step: counted, skipped with its cause in the metrics, or a clear error."""

import math

import pytest

from rlfw.algo.nonfinite import NonFiniteError, nonfinite_advantages, skipped_steps, verdict


def test_samples_with_a_non_finite_advantage_are_counted():
    advantages = [1.0, [0.0, math.nan], math.inf, [1.0, -2.0], -math.inf, [0.5]]
    assert nonfinite_advantages(advantages) == 3
    assert nonfinite_advantages([0.0, [1.0]]) == 0


def step(minibatch, grad_norm, **sums):
    return {"minibatch_index": minibatch, "grad_norm": grad_norm, "sums": sums}


def test_skipped_steps_are_counted_once_per_optimizer_step_by_cause():
    # Two replicas, three optimizer steps. Step 0: replica 1 saw an inf ratio, both skipped (NaN grads reach both).
    # Step 1: committed normally. Step 2: a NaN loss on replica 0 (the other had an empty share: no sums).
    results = {
        0: [step(0, None, nonfinite_ratio=0.0, nonfinite_loss=0.0), step(1, 0.5, nonfinite_ratio=0.0),
            step(2, None, nonfinite_ratio=0.0, nonfinite_loss=2.0)],
        1: [step(0, None, nonfinite_ratio=1.0, nonfinite_loss=1.0), step(1, 0.5, nonfinite_ratio=0.0), step(2, None)],
    }
    assert skipped_steps(results) == {"ratio": 1, "loss": 1}
    # A non-finite gradient from a finite loss (e.g. an overflow in the backward pass)
    assert skipped_steps({0: [step(0, None, nonfinite_ratio=0.0, nonfinite_loss=0.0)]}) == {"gradient": 1}
    assert skipped_steps({0: [step(0, 1.0, nonfinite_ratio=0.0, nonfinite_loss=0.0)]}) == {}


def test_skip_reports_the_count_and_cause_in_metrics():
    assert verdict("skip", 3, {"ratio": 2, "gradient": 1}) == {
        "train/skipped_steps": 3, "train/skipped_steps/ratio": 2, "train/skipped_steps/gradient": 1,
    }
    assert verdict("skip", 3, {}) == {"train/skipped_steps": 0}
    assert verdict("stop", 3, {}) == {"train/skipped_steps": 0}  # nothing skipped: nothing to stop for


def test_stop_raises_naming_the_step_and_the_quantity():
    with pytest.raises(NonFiniteError, match=r"step 7: non-finite ratio \(2 optimizer steps\).*on_nonfinite=stop"):
        verdict("stop", 7, {"ratio": 2})
    with pytest.raises(NonFiniteError, match=r"step 0: non-finite advantage \(1 optimizer step\) in 3 of 64 samples"):
        verdict("stop", 0, {"advantage": 1}, " in 3 of 64 samples")
    assert issubclass(NonFiniteError, FloatingPointError)
