"""What a failure costs, measured on both sides: cells against the checkpoint-restart loop users run today.

    .venv/bin/python bench/bench_faults.py [--steps 40 --every 10 --cells 2 --checkpoint-interval 10]
    .venv/bin/python bench/bench_faults.py --random 7 ...   # kills at steps drawn with seed 7, one per --every

The same kills on every side (SIGKILL mid forward/backward at the same steps, the cell or replica alternating), all
timed by one clock (``restart_loop.supervise``: the wall clock, and the moment each step line arrives):

- ``failure_free``: dp=cells without a kill (what the others lose against);
- ``cells``: dp=cells; a dead cell is dropped, the survivors redo the step on a fresh split, a replacement heals
  from a live peer; replacements are not waited for (ft.await_replacement_s=0). When every holder of the state dies
  the job restores its last checkpoint by itself (event ``state_restored``), counted as a restart;
- ``checkpoint_restart``: dp=classic with checkpoint.interval=K; a kill ends the job, the supervisor starts it
  again with resume=auto;
- ``cells_no_replace``: dp=cells ft.replace_failed=false ft.min_cells=<cells>: a kill ends the job after an
  emergency save inside the step, the supervisor restarts it.

Prints the table and writes the rows to outputs/bench/faults.json (see ``restart_loop.account`` for each figure).
"""

from __future__ import annotations

import argparse
import json
import random
from typing import List

from restart_loop import account, supervise
from runner import OUT, table


def kill_steps(steps: int, every: int, seed: int = None) -> List[int]:
    """Every ``every`` steps, or (``seed``) each step with probability 1/every; none in the last two steps (a kill
    there could fall after the work it should interrupt)."""
    if seed is None:
        return list(range(every, steps - 2, every))
    draw = random.Random(seed)
    return [s for s in range(1, steps - 2) if draw.random() < 1 / every]


def fault_overrides(steps: List[int]) -> List[str]:
    """The schedule: the first kill is ``fault.*`` (replica 1), the rest ``fault.extra_kills`` alternating between
    replicas 0 and 1, any incarnation (a restarted or restored job starts its cells afresh)."""
    if not steps:
        return []
    extra = [f"{{cell: {(n + 1) % 2}, step: {s}, phase: mid_forward_backward, incarnation: -1}}"
             for n, s in enumerate(steps[1:], start=1)]
    return ["fault=kill_once", "fault.cell=1", f"fault.step={steps[0]}", "fault.phase=mid_forward_backward",
            f"fault.extra_kills=[{', '.join(extra)}]"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--random", type=int, default=None, help="draw the kill steps with this seed")
    parser.add_argument("--cells", type=int, default=2, help="cells, and the classic world's replicas")
    parser.add_argument("--checkpoint-interval", type=int, default=10)
    parser.add_argument("--sides", nargs="+", default=["failure_free", "cells", "checkpoint_restart",
                                                          "cells_no_replace"])
    parser.add_argument("--out", default=str(OUT / "faults.json"))
    parser.add_argument("overrides", nargs="*", help="more overrides for every side")
    args = parser.parse_args()
    kills = kill_steps(args.steps, args.every, args.random)
    faults = fault_overrides(kills)
    common = [f"num_steps={args.steps}", f"checkpoint.interval={args.checkpoint_interval}",
              "checkpoint.save_final=false", *args.overrides]
    cells = ["dp=cells", f"dp.num_cells={args.cells}"]
    sides = {
        "failure_free": [*cells, *common],
        "cells": [*cells, "ft.await_replacement_s=0", *common, *faults],
        "checkpoint_restart": ["dp=classic", f"dp.size={args.cells}", *common, *faults],
        "cells_no_replace": [*cells, "ft.replace_failed=false", f"ft.min_cells={args.cells}", *common, *faults],
    }
    schedule = f"random seed {args.random}" if args.random is not None else f"every {args.every}"
    rows = []
    for side in args.sides:
        run_dir = OUT / f"faults_{side}"
        row = account(side, run_dir, supervise(run_dir, sides[side]))
        rows.append({"kills": schedule, "kill_steps": kills, "cells": args.cells, **row})
        print(f"{side}: {row['wall_s']:.0f} s, {row['restarts']} restarts", flush=True)
    headers = ["side", "cells", "kills", "failures", "restarts", "goodput", "ettr", "ettr training", "mttr median",
               "mttr max", "samples lost", "steps recomputed", "wall s"]
    print(table(headers, [[r["side"], r["cells"], r["kills"], r["failures"], r["restarts"], r["goodput"], r["ettr"],
                           r["ettr_training"],
                           r["mttr_median_s"] if r["mttr_median_s"] is not None else "-",
                           r["mttr_max_s"] if r["mttr_max_s"] is not None else "-",
                           r["samples_lost"], r["steps_recomputed"], r["wall_s"]] for r in rows]))
    OUT.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
