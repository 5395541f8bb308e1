"""GRPO: group-relative advantages and the clipped policy-gradient loss (with an optional k3 KL term).

Advantages are computed on whole prompt groups at rollout time, before any split, so a split can never cut a
group's statistics. The loss is a per-token quantity times a per-token *weight*; the weight carries the
normalisation (token mean or sample mean over the step's global batch), so the loss code does not care how the
batch was split or packed.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[int], normalize_std: bool = True, eps: float = 1e-6
) -> List[float]:
    """(r - mean of its group) / (std of its group + eps); without the std division when ``normalize_std`` is
    False (Dr. GRPO). Groups whose rewards are all equal get advantage 0."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    if not np.all(np.isfinite(rewards)):
        raise ValueError("group_advantages got a NaN or inf reward; filter bad samples before computing advantages")
    advantages = np.zeros_like(rewards)
    for group in np.unique(group_ids):
        members = group_ids == group
        if np.ptp(rewards[members]) == 0:
            continue  # all equal: exactly 0 (the float mean of e.g. 0.7, 0.7, 0.7 is not exactly 0.7)
        centred = rewards[members] - rewards[members].mean()
        if normalize_std:
            centred = centred / (rewards[members].std() + eps)
        advantages[members] = centred
    return advantages.tolist()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    ref_logprobs: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Sum over tokens of ``weights * (clipped PG loss + kl_coef * k3 KL)``.

    All tensors are per token and of one shape; tokens that carry no loss have weight 0. Returns the loss and
    weighted sums of diagnostics (so sums over micro-batches and replicas are global means).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {
        "pg_loss": (per_token * weights).sum().detach(),
        "clip_frac": ((clipped > unclipped).float() * weights).sum().detach(),
        "ratio": (ratio * weights).sum().detach(),
    }
    if ref_logprobs is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref): exp(ref - pi) - (ref - pi) - 1, unbiased and always >= 0.
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        stats["kl"] = (kl * weights).sum().detach()
    loss = (per_token * weights).sum()
    return loss, stats
