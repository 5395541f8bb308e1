"""What a NaN or inf does to a step: ``algo.on_nonfinite=stop`` raises, ``skip`` skips the optimizer step.

Where each quantity is caught:
- *advantage*: in the driver, on the whole rollout batch before it is split; the RL step trains nothing.
- *ratio* and *loss*: each replica counts the loss-carrying tokens whose ratio or loss is not finite, and then
  fills its gradient with NaN (``PolicyTrainer.forward_backward``). The cross-replica SUM reduction (Megatron DDP
  in classic mode, torchft across cells) carries that NaN to every replica, and each skips the same optimizer step
  because its gradient is not finite (``PolicyTrainer.optimizer_step``). One replica's verdict becomes everyone's
  without another collective, and classic and cells behave the same.
- *gradient*: a non-finite gradient from a finite loss is skipped the same way.

The weights never take a NaN in either mode: ``stop`` raises in the driver after the step was skipped, naming the
step and the quantity; ``skip`` reports ``train/skipped_steps`` (and per cause) in the metrics and carries on.
"""

from __future__ import annotations

import math
from typing import Any

from rlfw.algo.advantages import Advantages


class NonFiniteError(FloatingPointError):
    """A NaN or inf reached a step under ``algo.on_nonfinite=stop``."""


def nonfinite_advantages(advantages: Advantages) -> int:
    """How many samples have a non-finite advantage (on any of their tokens)."""
    return sum(
        not all(math.isfinite(a) for a in (value if isinstance(value, list) else [value])) for value in advantages
    )


def skipped_steps(results: dict[int, list[dict[str, Any]]]) -> dict[str, int]:
    """The optimizer steps skipped for a non-finite gradient, counted by cause (ratio, loss or gradient), from
    every replica's report of its committed steps (``results``: replica -> steps; a skipped step has no
    grad norm)."""
    counts: dict[int, dict[str, float]] = {}
    skipped = set()
    for steps in results.values():
        for s in steps:
            mb = counts.setdefault(s["minibatch_index"], {"nonfinite_ratio": 0.0, "nonfinite_loss": 0.0})
            for key in mb:
                mb[key] += s["sums"].get(key, 0.0)
            if s["grad_norm"] is None:
                skipped.add(s["minibatch_index"])
    causes: dict[str, int] = {}
    for index in skipped:
        mb = counts[index]
        cause = "ratio" if mb["nonfinite_ratio"] else "loss" if mb["nonfinite_loss"] else "gradient"
        causes[cause] = causes.get(cause, 0) + 1
    return causes


def verdict(on_nonfinite: str, step: int, causes: dict[str, int], detail: str = "") -> dict[str, float]:
    """Metrics of the skipped optimizer steps (``causes``: quantity -> steps), or ``NonFiniteError`` under stop."""
    if causes and on_nonfinite == "stop":
        what = ", ".join(f"{quantity} ({n} optimizer step{'s' * (n > 1)})" for quantity, n in sorted(causes.items()))
        raise NonFiniteError(
            f"step {step}: non-finite {what}{detail}; the step was not applied and the run stops "
            f"(algo.on_nonfinite=stop; algo.on_nonfinite=skip would skip such steps and carry on)"
        )
    return {"train/skipped_steps": sum(causes.values()), **{f"train/skipped_steps/{q}": n for q, n in causes.items()}}
