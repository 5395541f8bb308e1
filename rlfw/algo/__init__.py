"""The RL algorithm: advantage estimators (``advantages``), the policy loss and its options (``losses``), and what
a NaN does to a step (``nonfinite``)."""

from __future__ import annotations

from rlfw.algo.advantages import ESTIMATORS, TURN_CREDIT_ESTIMATORS

# Loss options whose value 0 means the term is off.
_OPTIONAL_TERMS = ("dual_clip_c", "kl_loss_coef", "kl_reward_coef", "entropy_coef", "tis_cap")


def algo_options(algo) -> list[list[str]]:
    """The algorithm a run uses, as (option, value) rows: the estimator with its own options, then the loss."""
    rows = [["estimator", algo.name]]
    rows += [[option, getattr(algo, option)] for option in ESTIMATORS[algo.name].options]
    if algo.name in TURN_CREDIT_ESTIMATORS:
        rows.append(["turn_discount", "off" if algo.turn_discount is None else algo.turn_discount])
    rows += [[key, getattr(algo, key)] for key in ("loss_agg", "clip_eps_low", "clip_eps_high")]
    rows += [[key, getattr(algo, key) or "off"] for key in _OPTIONAL_TERMS]
    if algo.kl_loss_coef > 0 or algo.kl_reward_coef > 0:
        rows.append(["kl_estimator", algo.kl_estimator])
    rows.append(["on_nonfinite", algo.on_nonfinite])
    return [[option, str(value)] for option, value in rows]
