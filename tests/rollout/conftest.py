"""Fixtures of the rollout tests."""

import pytest


@pytest.fixture(scope="session")
def ray_local(shared_ray):
    """The session's Ray on loopback (tests/conftest.py); its workers can import this folder's test tasks."""
