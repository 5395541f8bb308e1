"""What a cell failure costs, measured: time lost per failure, detection and heal times, and goodput under a kill
every K steps, side by side with what users have today (kill the whole job, restart, resume from a checkpoint).

    .venv/bin/python bench/bench_faults.py [--steps 40 --every 10]

Runs (same data and seed): dp=cells with no faults; dp=cells with a SIGKILL mid forward/backward every K steps,
alternating between the two cells' lineages (a replacement is killed again once it has healed); and a dp=classic
run to measure a fresh job's start-up. Replacements are not waited for (ft.await_replacement_s=0): the survivor
carries the whole batch until the replacement is ready, which is what a production run does.

The checkpoint-restart column is computed from measured parts, not from a run of it (``resume=auto`` exists now;
timing a real kill-and-resume loop is the next step): a restart's cost is start-up (measured here: process start to first step of a fresh job) plus redoing on average
half a checkpoint interval of steps (measured step time) plus the checkpoint writes (measured save time).
"""

from __future__ import annotations

import argparse
import json
import statistics

from runner import OUT, run_training, table


def kill_schedule(steps: int, every: int) -> str:
    kills = []
    for n, step in enumerate(range(every, steps - 2, every)):
        cell, incarnation = (1, n // 2) if n % 2 == 0 else (0, n // 2)
        kills.append(f"{{cell: {cell}, step: {step}, phase: mid_forward_backward, incarnation: {incarnation}}}")
    return "[" + ", ".join(kills) + "]"


def detection_times(run) -> list:
    """Seconds from each kill (the fault marker's timestamp) to the driver failing that cell."""
    kills = [json.loads(p.read_text()) for p in sorted((run["run_dir"] / "faults").glob("kill_*"))]
    failed = [e for e in run["events"] if e["kind"] == "cell_failed"]
    times = []
    for kill in kills:
        match = [e for e in failed if e["cell"] == kill["cell"] and e["incarnation"] == kill["incarnation"]]
        if match:
            times.append(match[0]["detected_at"] - kill["time"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--checkpoint-interval", type=int, default=10)
    args = parser.parse_args()
    common = [f"num_steps={args.steps}", "logger=jsonl", "dp=cells", "dp.num_cells=2", "checkpoint.save_final=false"]
    base = run_training("faults_none", common)
    schedule = kill_schedule(args.steps, args.every)
    faulty = run_training("faults_kill", [*common, "fault=kill_once", "fault.step=1000000", "fault.cell=0",
                                          f"fault.extra_kills={schedule}"])
    fresh = run_training("faults_fresh_job", ["num_steps=3", "logger=jsonl", "checkpoint.interval=1"])

    failures = [e for e in faulty["events"] if e["kind"] == "cell_failed"]
    heals = [e for e in faulty["events"] if e["kind"] == "heal"]
    base_train = sum(r["time/step"] for r in base["rows"])
    faulty_train = sum(r["time/step"] for r in faulty["rows"])
    lost_per_failure = (faulty_train - base_train) / max(len(failures), 1)
    samples = sum(r["train/num_samples"] for r in faulty["rows"])
    expected = sum(r["rollout/num_samples"] for r in faulty["rows"])
    step_s = statistics.median(r["time/step"] for r in base["rows"][3:])
    startup_s = fresh["first_step_s"]
    save_s = statistics.median(r["time/step"] for r in fresh["rows"][1:]) - statistics.median(
        r["time/step"] for r in run_training("faults_fresh_nosave", ["num_steps=3", "logger=jsonl",
                                                                       "checkpoint.save_final=false"])["rows"][1:])
    restarts_cost = len(failures) * (startup_s + step_s * args.checkpoint_interval / 2)
    saves_cost = max(save_s, 0.0) * args.steps / args.checkpoint_interval
    goodput_cells = samples / faulty_train
    goodput_restart = samples / (base_train + restarts_cost + saves_cost)
    row = {
        "kill every": args.every,
        "failures": len(failures),
        "samples lost": expected - samples,
        "lost s/failure": lost_per_failure,
        "detect s (median)": statistics.median(detection_times(faulty)) if failures else float("nan"),
        "heal s (median)": statistics.median(e["heal_time"] for e in heals) if heals else float("nan"),
        "goodput cells (samples/s)": goodput_cells,
        "goodput ckpt-restart (samples/s)": goodput_restart,
        "ratio": goodput_cells / goodput_restart,
        "fresh job start s": startup_s,
        "failure-free goodput": samples / base_train,
    }
    print(table(list(row), [list(row.values())]))
    (OUT / "faults.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
