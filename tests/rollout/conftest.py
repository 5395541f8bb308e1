"""Fixtures of the rollout tests."""

import os
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf


@pytest.fixture(scope="module")
def ray_local():
    """Ray on loopback; its workers inherit PYTHONPATH, so they can import this folder's test tasks."""
    from rlfw.cluster.ray_cluster import start_ray

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
        start_ray(OmegaConf.create({"address": None, "host": "127.0.0.1", "num_cpus": 2, "torch_threads": 1}))
        yield
        ray.shutdown()
