"""A role's figures of one RL step, from the records its replicas' train calls return, and the groups' events.

The same function serves every role: the per-replica batch sizes (``<group prefix>/<replica>/...``), the loss
terms as a mean per optimizer step, the grad norm, where a replica's step went (quorum, forward/backward,
reduce-and-vote), and the optimizer steps skipped for non-finite values; the role names them (``Role.train_key``).
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from rlfw.algo.nonfinite import skipped_steps, verdict
from rlfw.ft.goodput import GoodputMeter
from rlfw.loop.roles import Role

# Where a replica's step goes, and (cluster.placement=colocated) the state's handover and the call's peak memory.
REPLICA_FIGURES = ("time/quorum", "time/forward_backward", "time/reduce_and_vote", "time/state_release",
                   "time/state_restore", "offload/released_gib", "gpu/train_peak_gib")


def role_metrics(role: Role, results: Dict[int, List[Dict[str, Any]]], on_nonfinite: str, step: int
                 ) -> Dict[str, float]:
    """``results``: replica -> its committed minibatch records (``rlfw.ft.protocol.train_call``). Raises under
    ``algo.on_nonfinite=stop`` when a step was skipped (``rlfw.algo.nonfinite.verdict``)."""
    prefix, key = role.group.metric_prefix, role.train_key
    m: Dict[str, float] = {}
    sums: Dict[str, float] = {}
    num_steps = max((len(r) for r in results.values()), default=0)
    for replica, steps in results.items():
        m[f"{prefix}/{replica}/num_samples"] = sum(s["num_samples"] for s in steps)
        m[f"{prefix}/{replica}/num_tokens"] = sum(s["num_tokens"] for s in steps)
        m[f"{prefix}/{replica}/time_forward_backward"] = sum(s["time/forward_backward"] for s in steps)
        for s in steps:
            for k, v in s["sums"].items():
                sums[k] = sums.get(k, 0.0) + v
    for k, v in sums.items():  # weighted sums over minibatches -> mean per optimizer step
        m[key(k)] = v / max(num_steps, 1)
    m[key("num_samples")] = sum(m[f"{prefix}/{r}/num_samples"] for r in results)
    m[key("num_tokens")] = sum(m[f"{prefix}/{r}/num_tokens"] for r in results)
    m[key("optimizer_steps")] = num_steps
    for name in REPLICA_FIGURES:
        values = [s[name] for steps in results.values() for s in steps if name in s]
        if values:
            m[key(name)] = float(np.mean(values))
    norms = [s["grad_norm"] for steps in results.values() for s in steps if s.get("grad_norm") is not None]
    if norms:
        m[key("grad_norm")] = float(np.mean(norms))
    role.finish_metrics(m)
    m.update({role.key(k): v for k, v in verdict(on_nonfinite, step, skipped_steps(results)).items()})
    m.update({role.key(k): v for k, v in role.group.step_info().items()})
    return m


def log_events(loggers, meter: GoodputMeter, step: int, events: List[Dict[str, Any]], role: Role) -> None:
    """Log a role's group events at step ``step``; a failure among them starts the meter's MTTR clock."""
    for event in events:
        if event["kind"] == "cell_failed":
            meter.failure(event["detected_at"])
        loggers.event(event.pop("kind"), step, **_marked(role), **event)


def log_skips(loggers, step: int, results: Dict[int, List[Dict[str, Any]]], role: Role) -> None:
    """An event per quantity for which optimizer steps of the role were skipped (non-finite values)."""
    for quantity, count in skipped_steps(results).items():
        loggers.event("nonfinite_skip", step, **_marked(role), quantity=quantity, optimizer_steps=count)


class SignalWatch:
    """Says when the policy has learned nothing for ``steps`` steps in a row: its gradient norm was 0 in each (every
    advantage 0). The run then spends its time and learns nothing, and nothing fails, so an event says so
    (``no_learning_signal``, on the console and in every logger), once per such stretch, with the share of the last
    step's groups whose samples scored alike. Usual causes: a policy that samples one response per prompt (collapsed;
    from random initialisation, a learning rate too high for the model's width does it in a step or two,
    BENCHMARKS.md), or a reward that cannot tell the samples apart."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self._without = 0  # steps in a row without a gradient

    def observe(self, loggers, step: int, metrics: Dict[str, float], grad_norm_key: str) -> None:
        norm = metrics.get(grad_norm_key)
        if norm is None:  # nothing trained this step (every cell lost it): no verdict
            return
        self._without = self._without + 1 if norm == 0 else 0
        if self._without == self.steps:
            groups = metrics.get("rollout/num_groups", 0)
            loggers.event("no_learning_signal", step, steps=self.steps,
                          zero_variance_share=metrics.get("rollout/zero_variance_groups", 0) / groups if groups else None,
                          reason=f"the policy's gradient was 0 in the last {self.steps} steps (every advantage 0): "
                          "each group's samples scored alike; a policy that samples one response per prompt (a "
                          "learning rate too high for the model) or a reward that cannot tell them apart")


def _marked(role: Role) -> Dict[str, str]:
    return {"role": role.event_role} if role.event_role else {}
