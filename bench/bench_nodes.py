"""Cells against classic across nodes, and a node's loss, on a real multi-node Ray cluster (network namespaces).

    .venv/bin/python bench/bench_nodes.py [--steps 8] [--kill-after 2]

Needs root and ``ip netns`` (the cluster of tests/multinode: a head node for the driver and the engine, three
nodes that hold one trainer world of ``cluster.cpus_per_worker=3`` each). Three runs of ``python -m rlfw.train``
on the same data and seed, each joining the cluster as a user would:

- classic: one Megatron world of DP=2, its two ranks on two nodes;
- cells: two cells on two nodes;
- cells, node lost: after ``--kill-after`` committed steps every process of cell 1's node is SIGKILLed (the spare
  node takes the replacement, which heals from cell 0).

Per run: the median step time (``time/step`` of the steps without a failure). For the node loss, timed from
outside at the moment of the kill: until the driver failed the cell (its ``detected_at``), until the next
committed step (the ledger line, polled every 50 ms), until the replacement was placed and until it healed.
On a 2-core machine every process of every node shares the same two cores: ratios mean more than seconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multinode"))

from netns_cluster import NetnsCluster  # noqa: E402
from runner import OUT, ROOT, read_jsonl, table  # noqa: E402

CELL_CPUS = 3
RUN_TIMEOUT_S = 900.0  # one run of a few steps; past it the run is hung
COMMON = ["rollout.num_prompts=8", "logger=jsonl", "algo.max_tokens_per_microbatch=128", "checkpoint.interval=0",
          f"cluster.cpus_per_worker={CELL_CPUS}", "cluster.trainer_label_selector=role:train",
          "rollout.engine_label_selector=role:rollout"]


def lines(path: Path) -> list:
    return read_jsonl(path) if path.exists() else []


def run(cluster: NetnsCluster, name: str, overrides, steps: int, kill_after: int = -1) -> dict:
    run_dir = OUT / name
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "rlfw.train", *COMMON, *overrides, f"num_steps={steps}",
           f"cluster.address={cluster.head_address}", f"run_dir={run_dir}", f"hydra.run.dir={run_dir}"]
    proc = cluster.popen(0, *cmd, log=run_dir.parent / f"{name}.log", cwd=ROOT)
    killed_at, committed_after_kill, seen = None, None, 0
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} ran past {RUN_TIMEOUT_S:.0f} s")
        ledger = lines(run_dir / "ledger.jsonl")
        if len(ledger) > seen:
            seen = len(ledger)
            if killed_at is not None and committed_after_kill is None:
                committed_after_kill = time.time()
        if killed_at is None and kill_after >= 0 and seen >= kill_after:
            node = {e["cell"]: e["node"] for e in lines(run_dir / "events.jsonl") if e["kind"] == "cell_placed"}[1]
            cluster.kill_node(cluster.addresses.index(node))
            killed_at = time.time()
        time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed: {(run_dir.parent / f'{name}.log').read_text()[-3000:]}")
    rows, events = lines(run_dir / "metrics.jsonl"), lines(run_dir / "events.jsonl")
    failed_steps = {e["step"] for e in events if e["kind"] in ("cell_failed", "heal")}
    result = {"run": name, "steps": len(rows),
              "step_s": statistics.median(r["time/step"] for r in rows[1:] if r["step"] not in failed_steps)}
    if killed_at is not None:
        def first(kind, **fields):
            return next(e for e in events if e["kind"] == kind and all(e[k] == v for k, v in fields.items()))

        result.update(detect_s=first("cell_failed", cell=1)["detected_at"] - killed_at,
                      next_commit_s=committed_after_kill - killed_at,
                      # an event's time is when the loop logged it, at the end of the step it happened in
                      placed_by_s=first("cell_placed", cell=1, incarnation=1)["time"] - killed_at,
                      healed_by_s=first("heal", cell=1)["time"] - killed_at)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=2, help="committed steps before the node is killed")
    args = parser.parse_args()
    rollout, train = {"role": "rollout"}, {"role": "train"}
    results = []
    with NetnsCluster(4, [2, CELL_CPUS, CELL_CPUS, CELL_CPUS], [rollout, train, train, train]) as cluster:
        results.append(run(cluster, "nodes_classic", ["dp=classic", "dp.size=2"], args.steps))
        results.append(run(cluster, "nodes_cells", ["dp=cells"], args.steps))
        results.append(run(cluster, "nodes_cells_node_lost", ["dp=cells", "ft.await_replacement_s=120"],
                           args.steps, kill_after=args.kill_after))
    headers = ["run", "steps", "step_s", "detect_s", "next_commit_s", "placed_by_s", "healed_by_s"]
    print(table(headers, [[r.get(h, "") for h in headers] for r in results]))


if __name__ == "__main__":
    main()
