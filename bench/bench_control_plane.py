"""The cell protocol's control plane against the cell count: quorum formation, failure to next commit, re-split.

    .venv/bin/python bench/bench_control_plane.py [--cells 8 32 64]

Lightweight cells: each is one process running the real protocol (rlfw.ft.cell_sync.CellSync with a torchft
Manager, the step loop rlfw.ft.protocol.train_call) on a two-layer MLP, so the all-reduce is small and what is timed
is coordination: the Lighthouse, the Managers, the membership waits. The cells are those of the protocol tests
(tests/ft/protocol_harness.py, the same driver rules without Ray or Megatron). Per cell count, one cluster:

- steady step: a train call with every cell (wall time at the driver; the median of three);
- quorum: each cell's time in begin_step of a steady step (max over cells: the slowest join decides);
- failure to next commit: cell 1 is SIGKILLed inside the gradient all-reduce; the survivors' wall time from the
  kill (its marker's timestamp) to the end of the call, in which they retry and commit without it;
- re-split: splitting the step's minibatch over the survivors (``split_batch``, the work a re-split adds);
- rounds and messages: quorum requests per cell in the failed step (the join rounds of begin_step, counted by
  CellSync) and in all, and the torchft quorum ids the failure consumed.

On a 2-core machine wall times mostly measure contention between the cell processes; the counts do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ft"))

from protocol_harness import Cluster, minibatch  # noqa: E402
from runner import table  # noqa: E402

from rlfw.data.batch import split_batch  # noqa: E402


def measure(num_cells: int) -> dict:
    fault = dict(kind="kill_once", cell=1, step=4, phase="during_allreduce")
    samples = max(8, 2 * num_cells)  # two samples a cell: no empty share, before or after the failure
    with tempfile.TemporaryDirectory() as run_dir, Cluster(run_dir, fault, stall_timeout_s=30.0,
                                                           samples_per_step=samples) as cluster:
        t0 = time.monotonic()
        cells = cluster.spawn(*range(num_cells), timeout_s=120 + 10 * num_cells)
        spawn_s = time.monotonic() - t0
        step_timeout_s = 60 + 2 * num_cells
        cluster.train(cells, 0, timeout_s=step_timeout_s)  # the first quorum and process-group set-up
        steady, quorum = [], []
        for step in (1, 2, 3):
            t = time.monotonic()
            results = cluster.train(cells, step, timeout_s=step_timeout_s)
            steady.append(time.monotonic() - t)
            quorum.append(max(r["attempts"][0]["join_s"] for r in results))
        joins_before = [r["joins"] for r in results]
        results = cluster.dispatch(cells, 4).collect(step_timeout_s)
        done = time.time()
        marker = json.loads((Path(run_dir) / "faults" / "kill_0").read_text())
        survivors = [r for r in results if r is not None]
        mb = minibatch(4, samples)
        t = time.perf_counter()
        split_batch(mb, num_cells - 1, "balanced")
        resplit_s = time.perf_counter() - t
        attempts = survivors[0]["attempts"]
        joins = [r["joins"] - before for r, before in zip(results, joins_before) if r is not None]
        return {
            "cells": num_cells,
            "spawn_s": spawn_s,
            "steady_step_s": statistics.median(steady),
            "quorum_s": statistics.median(quorum),
            "failure_to_commit_s": done - marker["time"],
            "resplit_ms": resplit_s * 1000,
            "attempts": len(attempts),
            "quorum_requests_per_cell": statistics.median(joins),
            "quorum_requests": sum(joins),
            "quorum_ids_used": attempts[-1]["quorum_id"] - attempts[0]["quorum_id"],
            "committed_by": attempts[-1]["num_participants"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for n in args.cells:
        rows.append(measure(n))
        print(json.dumps(rows[-1]), flush=True)
    headers = list(rows[0])
    print(table(headers, [[r[h] for h in headers] for r in rows]))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
