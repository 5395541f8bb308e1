"""A soak: one long dp=cells run under a seeded storm of real faults, its invariants checked, its reward against a
failure-free run of the same seed.

    .venv/bin/python bench/soak.py [--steps 200 --every 8 --seed 0 --cells 2]

The schedule (``draw_faults``) mixes the failures a cluster sees, at the protocol's phases: SIGKILL before the
forward, mid forward/backward, during the all-reduce, after the vote, in the weight push and in a checkpoint save;
a stall the survivors outwait (SIGSTOP shorter than ft.stall_timeout_s) and one they must fence (longer); and a
replacement killed while it heals (a follow-up SIGKILL at ``heal_receive``). Kills can take out every holder of the
state: the job then restores its last checkpoint by itself (``state_restored``). The run is supervised like the
checkpoint-restart loop (``restart_loop.supervise``), so a job that still dies would be restarted and counted.

Checked while it runs (the run stops with an error on any breach): every sample of a step trained exactly once,
and every replica's weights bitwise equal after every step (ft.verify_weights_every=1). Checked after, from the
records: each of the steps kept once, every sample id of the run trained once, every scheduled fault fired (a soak
that killed nothing tested nothing: the run itself fails on an unfired one), and the final reward (mean of the last
``--tail`` steps) beside the failure-free run's. Prints the table and writes outputs/bench/soak.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from typing import Dict, List

from restart_loop import account, fault_markers, supervise
from runner import OUT, read_jsonl, table

CELL_PHASES = ("before_forward", "mid_forward_backward", "during_allreduce", "after_vote")
WRITER_PHASES = ("weight_sync", "checkpoint_save")  # only the writer gets there: whichever cell writes (cell -1)
STALL_TIMEOUT_S = 5.0  # ft.stall_timeout_s of the soak: a stop longer than this is fenced
SHORT_STOP_S, LONG_STOP_S = 2.0, 8.0
QUIET_TAIL = 40  # no fault in the last steps: a replacement must have time to heal so that every fault fires


def draw_faults(steps: int, every: int, cells: int, seed: int) -> List[Dict]:
    """About one fault per ``every`` steps, each a kind drawn with ``seed``: a kill at a phase (the writer's phases
    hit whichever cell writes), a short or a long stall, or a kill followed by the kill of its replacement while it
    heals. Any incarnation (a restored job starts its cells afresh)."""
    draw = random.Random(seed)
    faults = []
    step = every
    while step < steps - QUIET_TAIL:
        cell = draw.randrange(cells)
        kind = draw.choice(["kill", "kill", "writer_kill", "short_stop", "long_stop", "kill_healing"])
        base = {"cell": cell, "step": step, "incarnation": -1}
        if kind == "writer_kill":
            faults.append({**base, "cell": -1, "phase": draw.choice(WRITER_PHASES), "signal": "kill"})
        elif kind in ("kill", "kill_healing"):
            faults.append({**base, "phase": draw.choice(CELL_PHASES), "signal": "kill"})
            if kind == "kill_healing":  # the next heal of any cell (a restore's fresh cells heal from none) from
                # the sender's last committed step, step - 1
                faults.append({**base, "cell": -1, "step": step - 1, "phase": "heal_receive", "signal": "kill"})
        else:
            faults.append({**base, "phase": "mid_forward_backward", "signal": "stop",
                           "duration_s": SHORT_STOP_S if kind == "short_stop" else LONG_STOP_S})
        step += max(1, round(draw.expovariate(1 / every)))
    return faults


def schedule_overrides(faults: List[Dict]) -> List[str]:
    """``fault=kill_once`` with the first fault as ``fault.*`` and the rest as ``fault.extra_kills``."""
    def entry(f: Dict) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in f.items()) + "}"

    first = faults[0]
    return ["fault=kill_once", f"fault.cell={first['cell']}", f"fault.step={first['step']}",
            f"fault.phase={first['phase']}", f"fault.signal={first['signal']}",
            f"fault.duration_s={first.get('duration_s', 0.0)}",
            f"fault.extra_kills=[{', '.join(entry(f) for f in faults[1:])}]"]


def check_invariants(run_dir, steps: int, faults: List[Dict]) -> Dict:
    """From the run's records: every step kept once, every sample trained once, equal digests, every fault fired."""
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    kept = [r["step"] for r in ledger]
    assert kept == list(range(steps)), f"the ledger's steps are not 0..{steps - 1} once each: {kept}"
    ids = [i for r in ledger for i in r["sample_ids"]]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} samples trained more than once"
    unequal = [r["step"] for r in ledger if len(set(r["weight_digests"].values())) != 1]
    assert not unequal, f"replicas' weights differ after steps {unequal}"
    fired = fault_markers(run_dir)
    assert len(fired) == len(faults), f"{len(fired)} of {len(faults)} faults fired"
    return {"samples_trained_once": len(ids), "steps_with_equal_digests": len(ledger)}


def tail_reward(run_dir, tail: int) -> List[float]:
    return [r["reward/mean"] for r in read_jsonl(run_dir / "metrics.jsonl")][-tail:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=8, help="mean steps between faults")
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (the run's is seed=1)")
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--checkpoint-interval", type=int, default=10)
    parser.add_argument("--tail", type=int, default=20, help="final reward: the mean of this many last steps")
    parser.add_argument("--out", default=str(OUT / "soak.json"))
    parser.add_argument("overrides", nargs="*", help="more overrides for both runs")
    args = parser.parse_args()
    faults = draw_faults(args.steps, args.every, args.cells, args.seed)
    common = ["dp=cells", f"dp.num_cells={args.cells}", f"num_steps={args.steps}",
              f"checkpoint.interval={args.checkpoint_interval}", "checkpoint.keep_last=2", "checkpoint.save_final=false",
              "ft.verify_weights_every=1", *args.overrides]
    soak = [*common, f"ft.stall_timeout_s={STALL_TIMEOUT_S}", f"ft.max_state_restores={len(faults)}",
            *schedule_overrides(faults)]
    rows, rewards = [], {}
    for side, overrides in (("failure_free", common), ("soak", soak)):
        run_dir = OUT / f"soak_{side}"
        row = account(side, run_dir, supervise(run_dir, overrides, job_timeout_s=3600))
        row.update(check_invariants(run_dir, args.steps, faults if side == "soak" else []))
        rewards[side] = tail_reward(run_dir, args.tail)
        row["final_reward"] = statistics.mean(rewards[side])
        row["final_reward_std"] = statistics.stdev(rewards[side])
        events = read_jsonl(run_dir / "events.jsonl")
        row["state_restores"] = sum(e["kind"] == "state_restored" for e in events)
        row["fault_kinds"] = sorted({f"{f['signal']}@{f['phase']}" for f in faults}) if side == "soak" else []
        rows.append(row)
        print(f"{side}: {row['wall_s']:.0f} s, every invariant held", flush=True)
    headers = ["side", "steps", "failures", "restarts", "state restores", "goodput", "ettr", "mttr median",
               "mttr max", "samples lost", "final reward", "± std", "wall s"]
    print(table(headers, [[r["side"], r["steps"], r["failures"], r["restarts"], r["state_restores"], r["goodput"],
                           r["ettr"], r["mttr_median_s"] if r["mttr_median_s"] is not None else "-",
                           r["mttr_max_s"] if r["mttr_max_s"] is not None else "-", r["samples_lost"],
                           r["final_reward"], r["final_reward_std"], r["wall_s"]] for r in rows]))
    print(f"fault schedule (seed {args.seed}): {len(faults)} faults: " + ", ".join(
        f"{f['signal']}@{f['phase']} cell {f['cell']} step {f['step']}" for f in faults))
    OUT.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"faults": faults, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
