import pytest
from harness import run_rlfw


@pytest.fixture
def run(tmp_path):
    def _run(name, *overrides):
        return run_rlfw(tmp_path / name, *overrides)

    return _run
