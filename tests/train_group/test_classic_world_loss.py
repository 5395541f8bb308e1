"""A classic world that loses a rank ends its call with WorldLostError (status 75: restart with resume=auto),
whichever error reaches the driver first: the dead actor's, or a survivor's whose collective lost its peer."""

import os
import signal
import time
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir

from rlfw.config import register_configs
from rlfw.ft.errors import WorldLostError
from rlfw.train_group.classic import ends_on_death
from rlfw.train_group.world import World, get_all

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()


class RankZeroCaller:
    """The shape of ClassicGroup that ``ends_on_death`` relies on: a ``world``; its call reaches rank 0 only, so
    the error the driver sees is the survivor's, never the dead rank's."""

    def __init__(self, world):
        self.world = world

    @ends_on_death
    def digest_of_rank_zero(self):
        return get_all([self.world.workers[0].weights_digest.remote()])  # before set-up: raises AttributeError


@pytest.fixture
def world(shared_ray, tmp_path):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["dp=classic", "dp.size=2", f"run_dir={tmp_path}"])
    w = World(cfg, world_size=2, vocab_size=32, cell=None, sync_factory=None)
    ray.get(w.place(), timeout=60)
    ray.get(w.create_actors(), timeout=300)
    yield w
    w.shutdown(graceful=False)


def test_a_survivors_error_stands_while_every_rank_lives(world):
    assert world.dead_ranks() == []
    with pytest.raises(ray.exceptions.RayTaskError, match="AttributeError"):
        RankZeroCaller(world).digest_of_rank_zero()


def test_a_survivors_error_after_a_sigkilled_rank_is_the_worlds_loss(world):
    pid = ray.get(world.workers[1].pid.remote(), timeout=60)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while world.dead_ranks(timeout_s=5) != [1]:
        assert time.monotonic() < deadline, "Ray never reported the SIGKILLed rank dead"
    with pytest.raises(WorldLostError, match=r"rank 1 dead; a survivor saw AttributeError.*resume=auto"):
        RankZeroCaller(world).digest_of_rank_zero()


def test_a_stalled_rank_ends_the_classic_world_at_the_phase_deadline(make_group):
    """A rank stopped (a real SIGSTOP) outside any collective would keep the driver waiting for good: past the
    phase's deadline the world is lost, named, and the way on is resume=auto."""
    group, _ = make_group("dp=classic", "dp.size=2", "ft.stall_timeout_s=2", "ft.min_phase_timeout_s=3",
                          "ft.first_call_timeout_s=5")
    assert len(set(group.weights_digests().values())) == 1
    stalled = ray.get(group.world.workers[1].pid.remote(), timeout=60)
    os.kill(stalled, signal.SIGSTOP)
    try:
        with pytest.raises(WorldLostError, match=r"hung or stalled in weights_digests.*resume=auto"):
            group.weights_digests()
    finally:
        os.kill(stalled, signal.SIGCONT)
