import pytest
from harness import run_rlfw


@pytest.fixture(autouse=True)
def _ray(shared_ray):
    """Every e2e test here runs on the session's Ray (a subprocess run starts its own)."""


@pytest.fixture
def run(tmp_path):
    def _run(name, *overrides):
        return run_rlfw(tmp_path / name, *overrides)

    return _run
