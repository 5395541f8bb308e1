"""The cross-cell all-reduce alone: shared memory (ft.host_transport=shm) against torchft's Gloo group, side by side.

    .venv/bin/python bench/bench_transport.py [--members 2 3] [--mb 1 16 128] [--repeats 9]

Each member is a spawned process configured the way torchft's Manager configures its group (one TCPStore, one
quorum), and all-reduces (SUM) an fp32 tensor of each size ``repeats`` times; the table gives the median time of
the slowest member, its bus bandwidth (2 (n-1)/n x bytes / time, the usual all-reduce convention) and whether every
member got the same bits. Both groups are measured in the same processes, one after the other.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from datetime import timedelta

import torch
from torch.distributed import AllreduceOptions, ReduceOp, TCPStore

from runner import OUT, table


def member(rank, world, port, sizes_mb, repeats, conn):
    from torchft import ProcessGroupGloo

    from rlfw.ft.host_shared import ProcessGroupHostShared

    torch.set_num_threads(1)  # as a cell's worker runs (known-pitfalls: threads)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    out = {}
    for quorum, (name, cls) in enumerate((("shm", ProcessGroupHostShared), ("gloo", ProcessGroupGloo)), start=1):
        pg = cls(timeout=timedelta(seconds=120))
        pg.configure(f"127.0.0.1:{port}/torchft/{quorum}/0", f"cell_{rank}", rank, world, quorum_id=quorum)
        for mb in sizes_mb:
            t = torch.full((mb * 2**20 // 4,), float(rank + 1))
            times = []
            for _ in range(repeats + 1):  # the first one creates the segments / connections
                t.fill_(rank + 1)
                start = time.perf_counter()
                pg.allreduce([t], opts).wait()
                times.append(time.perf_counter() - start)
            out[(name, mb)] = (times[1:], bool((t == world * (world + 1) / 2).all()))
        pg.shutdown()
    conn.send(out)


def measure(world, sizes_mb, repeats):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(world)]
    procs = [ctx.Process(target=member, args=(r, world, store.port, sizes_mb, repeats, pipes[r][1]))
             for r in range(world)]
    for p in procs:
        p.start()
    replies = [pipes[r][0].recv() for r in range(world)]
    for p in procs:
        p.join(60)
    return replies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--members", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--mb", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    rows, out = [], []
    for world in args.members:
        replies = measure(world, args.mb, args.repeats)
        for mb in args.mb:
            row = {"members": world, "MB": mb}
            for name in ("shm", "gloo"):
                slowest = [max(r[(name, mb)][0][i] for r in replies) for i in range(args.repeats)]
                t = statistics.median(slowest)
                row[f"{name} ms"] = round(t * 1e3, 2)
                row[f"{name} GB/s"] = round(2 * (world - 1) / world * mb * 2**20 / t / 1e9, 2)
                row[f"{name} correct"] = all(r[(name, mb)][1] for r in replies)
            row["gloo / shm"] = round(row["gloo ms"] / row["shm ms"], 2)
            rows.append(list(row.values()))
            out.append(row)
    print(table(list(out[0]), rows))
    (OUT / "transport.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
