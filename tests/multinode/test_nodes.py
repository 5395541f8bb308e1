"""Cells on a real multi-node Ray cluster (network namespaces, ``netns_cluster``): a node lost with a spare present,
a node cut off with none, and a node that joins later — in one run, against the failure-free classic run.

The cluster: a head node labelled for rollout (the driver, the Lighthouse, the engine) and three nodes labelled for
training (``cluster.trainer_label_selector``, ``rollout.engine_label_selector``) that each hold exactly one cell
(``cluster.cpus_per_worker`` = a node's CPUs), so ``cluster.cell_placement=spread`` puts the two cells on two nodes
and leaves one spare. ``python -m rlfw.train`` runs in the head's namespace and joins with
``cluster.address`` and the default ``cluster.host=auto``, under Ray's token authentication. The test acts from
outside as the ledger of committed steps grows:

1. after step 1: every process of cell 1's node is SIGKILLed (a machine lost). The replacement goes to the spare
   node and heals from cell 0; the driver waits for it (``ft.await_replacement_s``) so the heal lands on a known step;
2. two steps later: cell 0's node is cut off the network (alive, unreachable). Ray declares it dead; cell 0 is
   failed and fenced; its replacement finds no room and waits (``placement_pending``) while the survivor
   commits the step alone on a fresh split;
3. then the link comes back (the stale cell can commit nothing, and its processes end: Ray declared the node
   dead) and a new node joins: the pending replacement is placed there, heals, and the group is back at two cells
   (regrowth).

Asserted: every sample trained exactly once, cells bitwise equal after every step, the final weights equal the
failure-free classic run's (1e-4, the tolerance of the other fault tests: a re-split sums in another order), each
cell's node as described, and every listener of rlfw's processes on each node bound to that node's address.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from harness import CLASSIC2, FAST, REFERENCE, check_every_sample_once, final_model, max_abs_diff, read_jsonl  # noqa

from netns_cluster import RAY_WORKER_PORTS, NetnsCluster  # noqa: E402

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CELL_CPUS = 3  # a node that holds a cell has exactly this many; the head has fewer
ROLLOUT, TRAIN = {"role": "rollout"}, {"role": "train"}  # Ray node labels: the engine on the head, cells elsewhere
RUN_TIMEOUT_S = 420.0
# The driver waits this long before a step for a replacement under way: long enough for the spare node's replacement
# to set up (about 5 s) and heal at the next step; a cut that lands between steps makes the survivor wait all of it
# for the replacement that has no room, before it commits alone (in a train call it retries alone at once).
AWAIT_S = 45
RLFW_PROCESSES = ("ray::TrainerWor", "ray::LocalEngin", "ray::RolloutMan")  # ss truncates process names


def wait_for(what, predicate, proc, log: Path, timeout_s=RUN_TIMEOUT_S):
    """Poll ``predicate`` until it holds; the run ending or the deadline first fails with the driver's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) while waiting for {what}:\n"
                                 + log.read_text()[-3000:])
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n" + log.read_text()[-3000:])


def committed(run_dir: Path) -> list:
    path = run_dir / "ledger.jsonl"
    return read_jsonl(path) if path.exists() else []


def events(run_dir: Path) -> list:
    path = run_dir / "events.jsonl"
    return read_jsonl(path) if path.exists() else []


def placed(run_dir: Path) -> dict:
    """(cell, incarnation) -> the node address it was placed on."""
    return {(e["cell"], e["incarnation"]): e["node"] for e in events(run_dir) if e["kind"] == "cell_placed"}


def rlfw_listeners(cluster: NetnsCluster, node: int, driver_pid: int) -> list:
    """(address, port, process) of the listening sockets of rlfw's processes on ``node`` — the driver and the
    actors — except Ray's own gRPC port in each of them (inside Ray's worker-port range)."""
    out = cluster.netns_exec(node, "ss", "-Hltnp").stdout
    found = []
    for line in out.splitlines():
        local, users = line.split()[3], line.split(maxsplit=5)[-1]
        address, port = local.rsplit(":", 1)
        ours = any(name in users for name in RLFW_PROCESSES) or f"pid={driver_pid}," in users
        if ours and not RAY_WORKER_PORTS[0] <= int(port) <= RAY_WORKER_PORTS[1]:
            found.append((address.strip("[]"), int(port), users.split('"')[1]))
    return found


def stale_trainers(cluster: NetnsCluster, node: int) -> list:
    """Trainer processes still running on ``node``."""
    alive = []
    for pid in cluster.pids(node):
        try:
            if psutil.Process(pid).name().startswith("ray::TrainerWor"):
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def cluster(netns_ok):
    with NetnsCluster(4, [2, CELL_CPUS, CELL_CPUS, CELL_CPUS], [ROLLOUT, TRAIN, TRAIN, TRAIN]) as c:
        yield c


def test_node_loss_partition_and_regrowth_on_a_real_cluster(cluster, reference_run, tmp_path):
    reference = reference_run(*CLASSIC2)
    run_dir = tmp_path / "run"
    overrides = [*FAST, "dp=cells", *REFERENCE, f"cluster.address={cluster.head_address}",
                 f"cluster.cpus_per_worker={CELL_CPUS}", "cluster.trainer_label_selector=role:train",
                 "rollout.engine_label_selector=role:rollout", f"ft.await_replacement_s={AWAIT_S}", f"run_dir={run_dir}",
                 f"hydra.run.dir={run_dir}"]
    log = tmp_path / "driver.log"
    proc = cluster.popen(0, sys.executable, "-m", "rlfw.train", *overrides, log=log, cwd=ROOT)
    try:
        wait_for("step 1", lambda: len(committed(run_dir)) >= 2, proc, log)
        nodes = {address: i for i, address in enumerate(cluster.addresses)}
        first = placed(run_dir)
        assert len({first[(0, 0)], first[(1, 0)]}) == 2 and cluster.addresses[0] not in first.values(), first
        for i in range(len(cluster.addresses)):  # both cells alive: every node's listeners, driver's included
            for address, port, who in rlfw_listeners(cluster, i, proc.pid):
                assert address == cluster.addresses[i], (i, address, port, who)
        assert {who for i in range(3) for _, _, who in rlfw_listeners(cluster, i, proc.pid)} >= {"python",
                                                                                                   "ray::TrainerWor"}
        spare = next(i for i in (1, 2, 3) if cluster.addresses[i] not in first.values())

        lost = nodes[first[(1, 0)]]
        cluster.kill_node(lost)  # 1. a machine lost; a spare is there
        wait_for("cell 1's replacement to heal", lambda: any(
            e["kind"] == "heal" and e["cell"] == 1 for e in events(run_dir)), proc, log)
        assert placed(run_dir)[(1, 1)] == cluster.addresses[spare]
        healed_at = len(committed(run_dir))

        cut = nodes[first[(0, 0)]]
        wait_for("a step after the heal", lambda: len(committed(run_dir)) >= healed_at + 1, proc, log)
        cluster.partition(cut)  # 2. cut off; no room left for a replacement
        wait_for("a step committed by the survivor alone", lambda: any(
            len(e["weight_digests"]) == 1 for e in committed(run_dir)[healed_at:]), proc, log)
        wait_for("cell 0's replacement pending (the step's events follow its ledger line)", lambda: any(
            e["kind"] == "placement_pending" and e["cell"] == 0 for e in events(run_dir)), proc, log)
        cluster.partition(cut, cut=False)  # 3. the link is back; the stale cell must not count
        new = cluster.start_node(CELL_CPUS, TRAIN)  # ... and a node joins
        assert proc.wait(timeout=RUN_TIMEOUT_S) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    log = events(run_dir)
    failures = [(e["cell"], e["incarnation"]) for e in log if e["kind"] == "cell_failed"]
    assert failures == [(1, 0), (0, 0)], failures
    assert placed(run_dir)[(0, 1)] == cluster.addresses[new]  # regrowth onto the node that joined
    assert sorted(e["cell"] for e in log if e["kind"] == "heal") == [0, 1]
    # Ray declared the cut-off node dead: reconnected, its raylet learns so and its workers end with it
    deadline = time.monotonic() + 30
    while stale_trainers(cluster, cut) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not stale_trainers(cluster, cut)
    ledger = check_every_sample_once(run_dir)
    assert len(ledger[-1]["weight_digests"]) == 2  # back at dp.num_cells
    assert max_abs_diff(final_model(run_dir), final_model(reference)) < 1e-4
    print(json.dumps({"failures": [e for e in log if e["kind"] in ("cell_failed", "heal", "cell_placed")]}))
