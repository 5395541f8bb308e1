"""Fault injection kills for real (SIGKILL of the process that reaches the phase), at every phase in every
configuration, and a scheduled kill that never fired is reported instead of passing for a successful fault test."""

import json
import signal

import pytest
from omegaconf import OmegaConf

import forked
from rlfw.config.schema import FaultConfig


def fault_cfg(**kwargs):
    return OmegaConf.structured(FaultConfig(**kwargs))


class MicrobatchTrainer:
    """A trainer's forward/backward reduced to what the fault point sees: the hook before each micro-batch.
    Each micro-batch it starts is recorded in ``log`` (a file), so the parent sees where the process died."""

    def __init__(self, microbatches: int, log: str):
        self.microbatches, self.log = microbatches, log

    def forward_backward(self, part, on_microbatch=None):
        for index in range(self.microbatches):
            on_microbatch(index)
            with open(self.log, "a") as f:
                f.write(f"{index}\n")
        return {}


def train_one_share(run_dir: str, microbatches: int) -> None:
    from rlfw.ft.faults import FaultInjector
    from rlfw.train_group.minibatches import forward_backward

    faults = FaultInjector(fault_cfg(kind="kill_once", cell=1, step=1, phase="mid_forward_backward"), run_dir,
                           cell=1, rank=0, incarnation=0)
    forward_backward(MicrobatchTrainer(microbatches, f"{run_dir}/microbatches"), None, faults, step=1)


@pytest.mark.parametrize("microbatches,finished", [(0, []), (1, ["0"]), (3, ["0"])])
def test_mid_forward_backward_kills_after_the_first_microbatch_however_many_there_are(tmp_path, microbatches,
                                                                                       finished):
    """With one micro-batch per cell (or an empty share) the phase used to be unreachable: nothing died."""
    child = forked.context().Process(target=train_one_share, args=(str(tmp_path), microbatches))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    assert (tmp_path / "faults" / "kill_0").exists()
    log = tmp_path / "microbatches"
    assert (log.read_text().split() if log.exists() else []) == finished


def test_unfired_kills_are_listed(tmp_path):
    from rlfw.ft.faults import unfired_kills

    fault = fault_cfg(kind="kill_once", cell=1, step=2, phase="after_vote",
                      extra_kills=[{"cell": 0, "step": 3, "phase": "weight_sync", "incarnation": -1}])
    assert len(unfired_kills(fault, str(tmp_path))) == 2
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "kill_0").write_text("{}")
    assert unfired_kills(fault, str(tmp_path)) == [{"cell": 0, "step": 3, "phase": "weight_sync", "incarnation": -1,
                                                   "signal": "kill", "duration_s": 0.0}]
    assert unfired_kills(fault_cfg(kind="random", probability=0.5), str(tmp_path)) == []
    assert unfired_kills(fault_cfg(kind="none"), str(tmp_path)) == []


def kill_at_random(run_dir: str) -> None:
    from rlfw.ft.faults import FaultInjector

    faults = FaultInjector(fault_cfg(kind="random", probability=1.0, phase="after_vote", seed=3), run_dir,
                           cell=0, rank=0, incarnation=0)
    faults.maybe_fault("before_forward", 4)  # another phase: no draw fires
    faults.maybe_fault("after_vote", 4)


def test_a_random_kill_leaves_its_marker_and_fires_once_per_run_directory(tmp_path):
    """A restarted job draws the same kill at the same cell, incarnation, step and phase: the marker stops it from
    firing again (else a restart loop under random faults would die at the same place for ever)."""
    spawn = forked.context()
    first = spawn.Process(target=kill_at_random, args=(str(tmp_path),))
    first.start()
    first.join(timeout=120)
    assert first.exitcode == -signal.SIGKILL
    marker = tmp_path / "faults" / "random_0_0_4_after_vote"
    record = json.loads(marker.read_text())
    assert (record["step"], record["phase"], record["signal"]) == (4, "after_vote", "kill")
    again = spawn.Process(target=kill_at_random, args=(str(tmp_path),))
    again.start()
    again.join(timeout=120)
    assert again.exitcode == 0
