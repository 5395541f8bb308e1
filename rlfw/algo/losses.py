"""The policy loss: clipped policy gradient with its options, KL to the reference, entropy bonus.

Every term is a per-token quantity times a per-token *weight*. The weight carries the aggregation (token mean,
sample mean, mean of per-sample token means) normalised by the optimizer step's *global* denominators
(``rlfw.megatron.packing.token_weights``), so a replica's loss is its share of one global mean: the loss and its
gradient do not depend on how the minibatch was split among replicas or packed into micro-batches, and the
replicas' gradients are SUMMED, never averaged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlfw.config.schema import AlgoConfig

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGREGATIONS = ("token_mean", "sample_mean", "seq_mean_token_mean")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs (Schulman's k1, k2, k3).

    k1 = log pi - log ref (unbiased, can be negative); k2 = (log pi - log ref)^2 / 2 (>= 0, biased);
    k3 = exp(ref - pi) - (ref - pi) - 1 (unbiased and >= 0).
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def needs_reference(algo: AlgoConfig) -> bool:
    """A frozen reference model is built (and its log-probs computed) when a KL term, in the loss or in the
    reward, uses it."""
    return algo.kl_loss_coef > 0 or algo.kl_reward_coef > 0


def old_logprobs_from_training(algo: AlgoConfig, num_minibatches: int) -> bool:
    """Whether the training forward's own log-probs (detached) serve as the old (proximal) policy's, with no
    separate pass before training (``algo.old_logprobs=auto``). They are the same values whenever the rollout is
    trained in one optimizer step: every micro-batch's forward runs on the weights the pass would have used. A
    rollout split into several minibatches needs the pass (the later ones train on moved weights), and so does a
    KL term (the reference model's log-probs come from the same pass)."""
    return algo.old_logprobs == "auto" and num_minibatches == 1 and not needs_reference(algo)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    algo: AlgoConfig,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over tokens of ``weights * per-token loss``, the per-token loss being

        tis * max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))   [capped at -A * c where A < 0: dual clip]
        + kl_loss_coef * KL(pi || ref)  -  entropy_coef * entropy

    with r = exp(logprobs - old_logprobs) and tis = min(exp(old_logprobs - rollout_logprobs), tis_cap), a constant
    weight that corrects for the engine sampling from a slightly different distribution than the trainer's.
    ``old_logprobs`` None: the old policy is the current one (``old_logprobs_from_training``), r = 1 in value.

    All tensors are per token and of one shape; tokens with weight 0 (prompts, sequence ends) carry no loss and
    their inputs are ignored, so whatever is padded there cannot turn into an inf or NaN. Returns the loss and
    weighted sums of diagnostics (sums over micro-batches and replicas are global means), plus counts of
    loss-carrying tokens whose ratio or loss is not finite.
    """
    active = weights != 0

    def on_active(values: torch.Tensor) -> torch.Tensor:
        return torch.where(active, values, torch.zeros_like(values))

    advantages = on_active(advantages)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    ratio = torch.exp(on_active(logprobs - old_logprobs))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - algo.clip_eps_low, 1.0 + algo.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": (clipped > unclipped).float(), "ratio": ratio}
    if rollout_logprobs is not None:  # the behaviour policy's distance from the proximal one (staleness, sync bugs)
        stats["logprob_abs_diff"] = (old_logprobs - rollout_logprobs).abs()
    if algo.dual_clip_c > 0:
        # Where A < 0 a huge ratio makes -A * r unbounded; dual clip caps it at -A * c.
        bound = -advantages * algo.dual_clip_c
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
        stats["dual_clip_frac"] = dual.float()
    if algo.tis_cap > 0:
        if rollout_logprobs is None:
            raise ValueError("algo.tis_cap > 0 needs the rollout engine's log-probs (batch column rollout_logprobs)")
        tis = torch.clamp(torch.exp(on_active(old_logprobs - rollout_logprobs)), max=algo.tis_cap).detach()
        per_token = per_token * tis
        stats["tis_weight"] = tis
    stats["pg_loss"] = per_token
    if algo.kl_loss_coef > 0:
        if ref_logprobs is None:
            raise ValueError("algo.kl_loss_coef > 0 needs the reference model's log-probs (ref_logprobs)")
        kl = kl_penalty(logprobs, torch.where(active, ref_logprobs, logprobs.detach()), algo.kl_estimator)
        per_token = per_token + algo.kl_loss_coef * kl
        stats["kl"] = kl
    if algo.entropy_coef > 0:
        if entropy is None:
            raise ValueError("algo.entropy_coef > 0 needs the per-token entropy")
        per_token = per_token - algo.entropy_coef * entropy
        stats["entropy"] = entropy
    stats = {key: on_active(value * weights).sum().detach() for key, value in stats.items()}
    stats["nonfinite_ratio"] = (active & ~torch.isfinite(ratio)).sum().detach()
    stats["nonfinite_loss"] = (active & ~torch.isfinite(per_token)).sum().detach()
    loss = on_active(per_token * weights).sum()
    return loss, stats
