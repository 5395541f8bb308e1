"""A checkpoint taken inside an RL step (the save below ``ft.min_cells``), and what the resumed run needs to
finish that step exactly.

The trainers' cursor (saved with their state) names the last minibatch their optimizer took; a resumed worker
skips every minibatch up to it (``rlfw.ft.protocol.train_call``). The remaining minibatches must train on the same
old log-probs, values and advantages as the first ones, and those came from the policy *before* the step, which
the checkpoint no longer holds. So the save also keeps the step's batch as it was trained (those columns included)
and how many minibatches each group committed; the resumed run trains the rest on that batch instead of generating
the step again, and its exactly-once check counts the minibatches done before the save.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlfw.data.batch import RolloutBatch

PARTIAL = "partial_step.pkl"


@dataclass
class PartialStep:
    step: int
    batch: RolloutBatch  # with old_logprobs, advantage (and PPO's old_values, returns): the step as it trained
    metrics: Dict[str, float]  # the rollout's and the log-prob phase's metrics, logged when the step completes
    examples: List[Any] = field(default_factory=list)  # the rollout's sample generations (the generations table)
    done: Dict[str, int] = field(default_factory=dict)  # role ("actor", "critic") -> minibatches committed
    complete: bool = False  # every minibatch committed (the step is logged and saved as done, never as partial)

    def done_sample_ids(self, role: str, minibatches: List[RolloutBatch]) -> List[int]:
        """The samples ``role`` trained before the save: every sample of its committed minibatches."""
        return [i for mb in minibatches[:self.done.get(role, 0)] for i in mb.sample_ids]


def write_partial(staging: Path, partial: PartialStep) -> None:
    """Into the staging directory, before the commit hashes it: a torn file fails ``verify`` like any other."""
    with open(Path(staging) / PARTIAL, "wb") as f:
        pickle.dump(partial, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_partial(checkpoint: Path) -> Optional[PartialStep]:
    """The interrupted step a verified checkpoint holds, or None for a checkpoint between steps."""
    path = Path(checkpoint) / PARTIAL
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)
