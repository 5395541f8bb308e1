"""Shared test setup: nothing leaves the machine, and worker processes stay single-threaded.

Every test that needs Ray shares one local instance (``shared_ray``): Ray's start-up is paid once per session (per
worker under ``pytest -n``, two in ``make test``: each test file runs on one worker, and the fault-free reference
runs are made once for all). Child processes without Ray (cells, ranks) are forks of one server that imported torch,
torchft and Megatron once (``forked``). In one process the end-to-end tests run after every fast test, so the fast
ones report first; two workers take the files with the most tests first (pytest-xdist's order for ``--dist loadfile``).
Nothing the session started outlives it: every process it starts inherits a mark in its environment, and one still
running when the session ends (a Ray worker, an engine's server, a scorer) fails the session, named, and is killed.
"""

import hashlib
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_BASE_URL", "http://127.0.0.1:9")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
SESSION_MARK = "RLFW_TEST_SESSION"
os.environ[SESSION_MARK] = str(os.getpid())  # inherited by every process the session starts, Ray's included
TEST_MARK = "RLFW_TEST_NODEID"  # the test running when a process started (a Ray worker's: when Ray started;
# a child forked by ``forked``'s server: when that server started)

import pytest

E2E_DIR = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)  # stable: fast tests first


def pytest_runtest_setup(item):
    os.environ[TEST_MARK] = item.nodeid


LEFTOVER_GRACE_S = 30.0  # processes told to stop as the session's Ray shut down are given this long to exit


def pytest_sessionfinish(session, exitstatus):
    """After every fixture's teardown (the shared Ray's shutdown included): fail the session if a process it
    started is still running, and kill it."""
    from process_marks import leftover_processes

    if "wandb" in sys.modules:  # W&B's service process serves this process' runs until it exits: ended first
        sys.modules["wandb"].teardown()
    leftovers = leftover_processes(SESSION_MARK, os.environ[SESSION_MARK], LEFTOVER_GRACE_S)
    if leftovers:
        names = ", ".join(describe(p) for p in leftovers)
        session.config.get_terminal_writer().line(
            f"FAILED: {len(leftovers)} processes the test session started outlived it (killed now): {names}", red=True)
        for process in leftovers:
            process.kill()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def describe(process) -> str:
    """A leftover process, with what tells where it came from."""
    try:
        return (f"{process.pid} (parent {process.ppid()}, started during {process.environ().get(TEST_MARK)}) "
                f"{' '.join(process.cmdline())[:100]!r}")
    except Exception as e:  # noqa: BLE001 - it may end while being described
        return f"{process.pid} ({e!r})"


@pytest.fixture(scope="session")
def shared_ray():
    """One local Ray for every test that needs one; its workers can import the e2e and rollout folders' test
    tasks (workers inherit PYTHONPATH from the environment Ray started in)."""
    from omegaconf import OmegaConf

    from rlfw.cluster.ray_cluster import keep_ray_running
    from rlfw.config.schema import ClusterConfig

    folders = (str(E2E_DIR), str(Path(__file__).parent / "rollout"), os.environ.get("PYTHONPATH"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in folders if p)
    with keep_ray_running(OmegaConf.structured(ClusterConfig())):
        yield


REFERENCE_WAIT_S = 1800.0  # a reference run another worker is making: at most this long (it is one 10-step run)
DONE = "REFERENCE_DONE"  # in a reference run's folder once it has finished


@pytest.fixture(scope="session")
def reference_run(shared_ray, tmp_path_factory):
    """``reference_run(*overrides)``: the run directory of a fault-free run of those overrides, run once per test
    session and shared by every test that compares against it, whichever worker (``pytest -n``) runs that test: the
    first to need it makes it under a file lock in the session's temporary folder, the others wait and read it."""
    from filelock import FileLock

    sys.path.insert(0, str(E2E_DIR))
    from harness import run_rlfw

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder

    def get(*overrides):
        run_dir = shared / f"reference-{hashlib.sha1(repr(overrides).encode()).hexdigest()[:12]}"
        with FileLock(f"{run_dir}.lock", timeout=REFERENCE_WAIT_S):
            if not (run_dir / DONE).exists():
                shutil.rmtree(run_dir, ignore_errors=True)  # one a failed test left half made
                run_rlfw(run_dir, *overrides)
                (run_dir / DONE).touch()
        return run_dir

    return get

