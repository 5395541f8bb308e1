"""The exactly-once ledger: every sample of a step trained once per role, in one commit, on equal replicas.

After each step, per role, the loop derives the samples trained in committed optimizer steps from what the
surviving replicas report (a dead replica's share is vouched for by its peers), refuses a step where a sample is
missing, twice, or a minibatch was committed twice, and checks that the replicas hold bitwise-equal weights. The
ledger file (``ledger.jsonl``) gets one record per step: the policy's trained sample ids and each role's digests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from rlfw.data.batch import RolloutBatch
from rlfw.run_files import LEDGER
from rlfw.train_group.group import TrainGroup


def trained_sample_ids(results: Dict[int, List[Dict[str, Any]]]) -> List[int]:
    """The sample ids trained in committed optimizer steps, from what the surviving replicas report.

    A replica that died after contributing to a committed step reports nothing; its share is known from any
    survivor of that step (``participant_ids``: every participant's part, which they all agreed on). Every report
    of one minibatch must name the same commit (quorum id, torchft step, participants): two commits of one
    minibatch would be a fork, replicas that trained it apart.
    """
    per_minibatch: Dict[int, List[int]] = {}
    commits: Dict[int, tuple] = {}
    own: Dict[int, List[int]] = {}
    for replica, steps in results.items():
        for s in steps:
            mb = s["minibatch_index"]
            own.setdefault(mb, []).extend(s["sample_ids"])
            commit = (s.get("quorum_id"), s.get("ft_step"), s.get("num_replicas"))
            if commits.setdefault(mb, commit) != commit:
                raise RuntimeError(f"minibatch {mb} was committed twice: (quorum id, torchft step, participants) "
                                   f"{commits[mb]} vs {commit} of replica {replica}")
            if s.get("participant_ids") is not None:
                ids = [i for p in s["participant_ids"] for i in p]
                if mb in per_minibatch and sorted(per_minibatch[mb]) != sorted(ids):
                    raise RuntimeError(f"replicas report different participant shares for minibatch {mb}")
                per_minibatch[mb] = ids
    return [i for mb in sorted(own) for i in per_minibatch.get(mb, own[mb])]


def check_exactly_once(batch: RolloutBatch, trained_ids: List[int]) -> None:
    """Every sample of the rollout batch trained exactly once in a committed step, or a loud error."""
    if sorted(trained_ids) != sorted(batch.sample_ids):
        missing = set(batch.sample_ids) - set(trained_ids)
        twice = len(trained_ids) - len(set(trained_ids))
        unknown = set(trained_ids) - set(batch.sample_ids)
        raise RuntimeError(
            f"sample accounting failed: {len(missing)} samples never trained, {twice} trained more than once, "
            f"{len(unknown)} not in the rollout batch"
        )


def verify_replicas_equal(group: TrainGroup, step: int) -> Dict[str, str]:
    """Every replica's weights must be bitwise equal after a committed step; a difference stops the run."""
    digests = group.weights_digests()
    if len(set(digests.values())) > 1:
        raise RuntimeError(f"step {step}: replicas hold different weights: {digests}")
    return {str(k): v for k, v in digests.items()}


class Ledger:
    """``ledger.jsonl`` of the run directory, appended a line per committed step (line-buffered: a crash loses
    at most the step under way, which a resumed job redoes)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LEDGER
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: Dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def reopen(self) -> None:
        """After the step logs were rewound (a restore): append to the rewound file, not the replaced one."""
        self._file.close()
        self._file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        self._file.close()
