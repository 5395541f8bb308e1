"""CellSync against real torchft (Lighthouse, Manager via make_manager, Gloo), one spawned process per cell, no
Megatron: what a user relies on when a cell trains, dies, or is replaced.

Each scenario runs once per module (a fixture) and several tests read what it recorded, so the file spawns nine
cell processes in all (and three more for the forward/backward deaths). The harness (protocol_harness.py) says how a cell is built and driven.
"""

from __future__ import annotations

import ast
import inspect
import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchft.manager as tft_manager
from torchft import Manager

from protocol_harness import HOST, Cluster, assert_bitwise_equal, minibatch, reference
from rlfw.ft.protocol import GradSync, SyncHost

pytestmark = pytest.mark.timeout(300)  # a backstop: every wait in the harness has its own, shorter deadline
torch.set_num_threads(1)  # the reference must run the cells' kernels (they use one thread) to match them bitwise
RLFW = Path(__file__).resolve().parents[2] / "rlfw"
KILLED = -signal.SIGKILL


def committed_ids(results, step):
    """The sample ids that the step's committed attempts trained, over every cell (a dead cell trained none)."""
    return sorted(i for r in results if r is not None for i in r["attempts"][-1]["sample_ids"])


def all_ids(step):
    return sorted(minibatch(step).sample_ids)


def kill_marker(run_dir, index):
    """Who fired kill ``index`` of the fault schedule (rlfw.ft.faults writes the marker just before the SIGKILL)."""
    return json.loads((Path(run_dir) / "faults" / f"kill_{index}").read_text())


def assert_same_state(a, b, keys=("weights", "optimizer", "cursor", "rng")):
    for key in keys:
        assert_bitwise_equal(a[key], b[key], key)


# ------------------------------------------------------------------------------------------------- scenarios
@pytest.fixture(scope="module")
def steady(tmp_path_factory):
    """Two cells, three steps, no fault."""
    with Cluster(tmp_path_factory.mktemp("steady")) as cluster:
        cells = cluster.spawn(0, 1)
        steps = [cluster.train(cells, step) for step in range(3)]
        return SimpleNamespace(probes=[c.probe for c in cells], steps=steps, listening=cluster.call(cells, "listening"),
                               transport=cluster.call(cells, "transport"))


@pytest.fixture(scope="module", params=["shm", "gloo"])
def kill_and_heal(tmp_path_factory, request):
    """Cell 1 is SIGKILLed inside step 1's gradient all-reduce (Gloo), or right after it, with its peer in the
    agreement's (shared memory: its all-reduce returns done); a replacement (incarnation 1) joins for step 2. Once
    per ft.host_transport."""
    run_dir = tmp_path_factory.mktemp("kill_and_heal")
    with Cluster(run_dir, dict(kind="kill_once", cell=1, step=1, phase="during_allreduce"),
                 host_transport=request.param) as cluster:
        first = cluster.spawn(0, 1)
        steps = [cluster.train(first, 0), cluster.train(first, 1)]
        exitcode = first[1].exitcode
        replacement = cluster.spawn(1, incarnation=1)
        steps.append(cluster.train(first[:1] + replacement, 2))
        transport = cluster.call(first[:1] + replacement, "transport")
        return SimpleNamespace(steps=steps, exitcode=exitcode, run_dir=run_dir, transport=transport,
                               host_transport=request.param)


@pytest.fixture(scope="module")
def heal_deaths(tmp_path_factory):
    """Cells 0 and 1 train step 0. Step 1: replacement cell 2 heals and its sender dies in heal_send; the retry heals
    it from the other first cell. Step 2: replacement cell 3 dies in heal_receive, having received the state."""
    run_dir = tmp_path_factory.mktemp("heal_deaths")
    fault = dict(kind="kill_once", cell=-1, step=0, phase="heal_send",  # whichever first cell sends (step: its cursor)
                 extra_kills=[dict(cell=3, step=0, phase="heal_receive", incarnation=1)])
    with Cluster(run_dir, fault) as cluster:
        first = cluster.spawn(0, 1)
        step0 = cluster.train(first, 0)
        receiver = cluster.spawn(2, incarnation=1)
        step1 = cluster.train(first + receiver, 1)
        exitcodes1 = [p.exitcode for p in first]
        survivors = [p for p, r in zip(first, step1) if r is not None] + receiver
        doomed = cluster.spawn(3, incarnation=1)
        step2 = cluster.train(survivors + doomed, 2)
        return SimpleNamespace(steps=[step0, step1, step2], exitcodes1=exitcodes1, exitcode3=doomed[0].exitcode,
                               run_dir=run_dir)


@pytest.fixture(scope="module")
def forward_deaths(tmp_path_factory):
    """Three cells. Step 0: cell 2 is SIGKILLed before its forward pass; step 1: cell 1 between its two
    micro-batches (mid_forward_backward, the worker's own fault point). Each step is retried by the survivors."""
    run_dir = tmp_path_factory.mktemp("forward_deaths")
    fault = dict(kind="kill_once", cell=2, step=0, phase="before_forward",
                 extra_kills=[dict(cell=1, step=1, phase="mid_forward_backward")])
    with Cluster(run_dir, fault) as cluster:
        cells = cluster.spawn(0, 1, 2)
        steps = [cluster.train(cells, 0), cluster.train(cells[:2], 1)]
        return SimpleNamespace(steps=steps, exitcodes=[p.exitcode for p in cells], run_dir=run_dir)


# ------------------------------------------------------------------------------------------------------ tests
def test_grad_sync_is_what_the_worker_calls_and_both_syncs_implement_it():
    """The worker (and train_call, its step loop) depend on GradSync only, and ClassicSync and CellSync provide all
    of it (read from source: the classic module imports Ray)."""

    def methods(path, name):
        [cls] = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name]
        return {f.name: len(f.args.args) for f in cls.body if isinstance(f, ast.FunctionDef)}

    def called_on(path, receiver):
        """Attributes read of ``self.sync`` (receiver "self") or of a plain name ``sync``."""
        tree = ast.parse(path.read_text())
        return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and (
            receiver == "self" and isinstance(n.value, ast.Attribute) and n.value.attr == "sync"
            and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"
            or receiver == "sync" and isinstance(n.value, ast.Name) and n.value.id == "sync")}

    def attributes(path, name):
        """Names a class binds: at its top (``name = ...``) or on ``self`` in a method."""
        [cls] = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name]
        return {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)} | {
            t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}

    called = (called_on(RLFW / "train_group" / "worker.py", "self") | called_on(RLFW / "ft" / "protocol.py", "sync")
              | called_on(RLFW / "train_group" / "minibatches.py", "sync"))
    protocol = {name: len(inspect.signature(fn).parameters) for name, fn in vars(GradSync).items()
                if inspect.isfunction(fn) and not name.startswith("_")}
    assert called == set(protocol) | set(GradSync.__annotations__)
    for path, name in (("ft/cell_sync.py", "CellSync"), ("train_group/classic.py", "ClassicSync")):
        implemented = methods(RLFW / path, name)
        assert {m: implemented.get(m) for m in protocol} == protocol, name
        assert set(GradSync.__annotations__) <= attributes(RLFW / path, name), name


def test_cell_sync_reads_exactly_the_sync_host_protocol_of_its_worker():
    tree = ast.parse((RLFW / "ft" / "cell_sync.py").read_text())
    read = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and (
            isinstance(n.value, ast.Name) and n.value.id == "worker"
            or isinstance(n.value, ast.Attribute) and n.value.attr == "worker"
        ):
            read.add(n.attr)
    assert read == set(SyncHost.__annotations__)


def test_two_cells_commit_every_step_and_match_a_single_process_sum(steady):
    """Bitwise, not 1e-6: with two participants each element of Gloo's SUM is one IEEE addition a + b, which does
    not depend on the order, and the reference computes each part's gradient with the same kernels (one thread,
    same shapes) and adds the two. Pins the SUM (an average would halve the gradient) and the identical starts."""
    ref = reference([2, 2, 2])
    for step, results in enumerate(steady.steps):
        assert [len(r["attempts"]) for r in results] == [1, 1], f"step {step} needed a retry without a fault"
        attempts = [r["attempts"][0] for r in results]
        assert all(a["committed"] and a["num_participants"] == 2 for a in attempts)
        assert sorted(a["rank"] for a in attempts) == [0, 1]
        assert committed_ids(results, step) == all_ids(step)  # each sample trained once
        for a in attempts:
            assert_bitwise_equal(a["grads"], ref[step]["grads"], f"step {step} reduced gradient")
    final = [r["after"] for r in steady.steps[-1]]
    assert_same_state(final[0], final[1], keys=("weights", "optimizer", "cursor"))
    assert_same_state(final[0], ref[-1], keys=("weights", "optimizer"))
    assert final[0]["cursor"] == {"rl_step": 2, "minibatch_index": 0, "optimizer_steps": 3}


def test_cells_of_one_host_all_reduce_through_shared_memory_by_default(steady):
    """Every all-reduce of the steady run (per step: the gradient buffer and the agreement vector's) went through
    shared memory, the same count in both cells."""
    assert [t["backend"] for t in steady.transport] == ["rlfw-host-shared"] * 2
    assert [t["fallback_reason"] for t in steady.transport] == [None, None]
    counts = {t["shared_allreduces"] for t in steady.transport}
    assert len(counts) == 1 and counts.pop() >= 2 * len(steady.steps)


def test_the_kill_and_heal_run_used_the_transport_it_was_given(kill_and_heal):
    backends = {t["backend"] for t in kill_and_heal.transport}
    assert backends == {"rlfw-host-shared" if kill_and_heal.host_transport == "shm" else "torchft-gloo"}
    if kill_and_heal.host_transport == "shm":  # the replacement's all-reduces of step 2 went through it as well
        assert all(t["shared_allreduces"] > 0 for t in kill_and_heal.transport)


def test_a_killed_cells_step_is_retried_and_committed_by_the_survivor_alone(kill_and_heal):
    steps = kill_and_heal.steps
    assert kill_and_heal.exitcode == KILLED and steps[1][1] is None
    assert kill_marker(kill_and_heal.run_dir, 0)["cell"] == 1
    failed, *_, committed = steps[1][0]["attempts"]
    assert not failed["committed"] and failed["num_participants"] == 2
    assert not failed["grads"].any(), "a discarded step must leave the grads zeroed"
    assert committed["committed"] and committed["num_participants"] == 1
    for step in (0, 1):
        assert committed_ids(steps[step], step) == all_ids(step)  # step 1: the survivor trained the whole minibatch
    ref = reference([2, 1])
    assert_bitwise_equal(committed["grads"], ref[1]["grads"], "retried gradient")
    assert_same_state(steps[1][0]["after"], ref[1], keys=("weights", "optimizer"))  # the failed try left no trace


def test_a_replacement_heals_from_the_live_peer_inside_begin_step(kill_and_heal):
    """Step 2: the replacement's state right after begin_step is the sender's (weights, Adam moments and step,
    cursor, RNG); both then train their halves and end bitwise equal to the single-process reference."""
    sender, replacement = kill_and_heal.steps[2]
    [s], [r] = sender["attempts"], replacement["attempts"]
    assert s["committed"] and r["committed"] and s["num_participants"] == r["num_participants"] == 2
    assert "heal_time" in r["info"] and "heal_time" not in s["info"]
    assert r["info"]["ft_step"] == s["info"]["ft_step"] == 3
    assert_same_state(r["after_begin"], s["after_begin"])
    assert r["after_begin"]["cursor"] == {"rl_step": 1, "minibatch_index": 0, "optimizer_steps": 2}
    assert committed_ids(kill_and_heal.steps[2], 2) == all_ids(2)
    assert_same_state(replacement["after"], sender["after"])
    assert_same_state(sender["after"], reference([2, 1, 2])[2], keys=("weights", "optimizer"))


def test_the_heal_senders_death_is_retried_and_the_replacement_heals_from_the_other_peer(heal_deaths):
    step1 = heal_deaths.steps[1]
    [dead] = [cell for cell, code in enumerate(heal_deaths.exitcodes1) if code is not None]  # cells 0 and 1
    assert heal_deaths.exitcodes1[dead] == KILLED and step1[dead] is None
    assert kill_marker(heal_deaths.run_dir, 0)["cell"] == dead
    holder, receiver = [r for r in step1 if r is not None]
    for result in (holder, receiver):
        # Whether the quorum with the dying sender is seen depends on when the driver counts its death: if it
        # comes first, begin_step asks again at once; if not, that attempt fails in its all-reduce. Never commits.
        assert all(not a["committed"] and a["num_participants"] == 3 for a in result["attempts"][:-1])
    # The heal may land in an attempt that is then discarded (see begin_step's join wait); it stays applied, and it
    # is reported with the attempt that commits (the worker reports no other, so the driver's heal event needs it).
    h, r = holder["attempts"][-1], receiver["attempts"][-1]
    assert "heal_time" in r["info"] and "heal_time" not in h["info"]
    assert h["num_participants"] == r["num_participants"] == 2
    assert_same_state(r["after_begin"], h["after_begin"])
    assert committed_ids(step1, 1) == all_ids(1)
    assert_same_state(receiver["after"], holder["after"])
    assert_same_state(holder["after"], reference([2, 2])[1], keys=("weights", "optimizer"))


def test_the_heal_receivers_death_is_retried_by_the_others(heal_deaths):
    *survivors, doomed = heal_deaths.steps[2]
    assert doomed is None and heal_deaths.exitcode3 == KILLED
    marker = kill_marker(heal_deaths.run_dir, 1)
    assert (marker["cell"], marker["incarnation"]) == (3, 1)
    for result in survivors:
        failed, committed = result["attempts"][0], result["attempts"][-1]
        assert not failed["committed"] and failed["num_participants"] == 3
        assert committed["committed"] and committed["num_participants"] == 2
    assert committed_ids(heal_deaths.steps[2], 2) == all_ids(2)
    assert_same_state(survivors[0]["after"], survivors[1]["after"])
    assert_same_state(survivors[0]["after"], reference([2, 2, 2])[2], keys=("weights", "optimizer"))


def test_quorum_id_changes_when_membership_does(steady, kill_and_heal):
    """And not without a fault. (torchft 0.2.0 also bumps it on a quorum after a failed commit, so it is an epoch
    of the process group's configuration rather than of membership alone.)"""
    assert len({a["quorum_id"] for step in steady.steps for r in step for a in r["attempts"]}) == 1
    step0, step1, step2 = kill_and_heal.steps
    [q0] = {r["attempts"][-1]["quorum_id"] for r in step0}
    assert q0 >= 1
    failed, *_, alone = step1[0]["attempts"]
    assert failed["quorum_id"] == q0  # the quorum the death happened in
    assert alone["quorum_id"] > q0
    [q2] = {r["attempts"][-1]["quorum_id"] for r in step2}
    assert q2 > alone["quorum_id"]


def test_torchft_private_names_rlfw_depends_on_still_exist(steady):
    """rlfw/ft/torchft_api.py replaces torchft.manager.ManagerServer, which Manager.__init__ looks up in its module
    at call time, and reads Manager._quorum_id (-1 until the first quorum)."""
    assert isinstance(tft_manager.ManagerServer, type)
    assert "ManagerServer" in Manager.__init__.__code__.co_names
    assert [p["quorum_id"] for p in steady.probes] == [-1, -1]
    # rlfw.ft.torchft_api.manager_replica_id reads REPLICA_ID_KEY from the cell's store
    assert [p["replica_id"].split(":")[0] for p in steady.probes] == ["cell_0", "cell_1"]
    assert all(len(p["replica_id"].split(":")[1]) == 36 for p in steady.probes)  # a uuid4 per incarnation


def test_the_manager_server_listens_on_the_configured_host_only(steady):
    """The sockets a cell starts listening on while make_manager runs are its ManagerServer's; and no socket of a
    cell, after a few steps (Gloo groups configured), listens on every interface."""
    for probe in steady.probes:
        assert probe["manager_server"] and {ip for ip, _ in probe["manager_server"]} == {HOST}
    for sockets in steady.listening:
        assert not [s for s in sockets if s[0] in ("0.0.0.0", "::")], sockets


def test_cells_killed_before_and_inside_their_forward_backward_are_retried_by_the_survivors(forward_deaths):
    """The worker's own minibatch loop (rlfw.train_group.minibatches) reaches both fault points; each failed step
    leaves no trace, the retry trains the whole minibatch once, bitwise as one process would."""
    steps = forward_deaths.steps
    assert forward_deaths.exitcodes == [None, KILLED, KILLED]  # cell 0 lives on
    assert steps[0][2] is None and steps[1][1] is None
    assert [kill_marker(forward_deaths.run_dir, i)["phase"] for i in (0, 1)] == ["before_forward",
                                                                                "mid_forward_backward"]
    ref = reference([2, 1])
    for step, participants in ((0, 2), (1, 1)):
        failed, *_, committed = steps[step][0]["attempts"]
        assert not failed["committed"] and committed["committed"] and committed["num_participants"] == participants
        assert committed_ids(steps[step], step) == all_ids(step)
        assert_bitwise_equal(committed["grads"], ref[step]["grads"], f"step {step} retried gradient")
    assert_same_state(steps[1][0]["after"], ref[1], keys=("weights", "optimizer"))
