"""``python -m rlfw.report`` on run and sweep directories written by the real ``JsonlLogger``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from rlfw.logging import JsonlLogger
from rlfw.report.__main__ import main
from rlfw.report.figures import DPI, RUN_FIGSIZE, SWEEP_FIGSIZE
from rlfw.report.load import load_run
from rlfw.run_files import write_failure

ROOT = Path(__file__).resolve().parents[2]
RUN_PANELS = ["Reward (mean ± std)", "Loss", "Samples per replica", "Response tokens per replica",
              "Alive cells and quorum id", "Events", "Goodput and ETTR", "MTTR of the last failure"]


def write_run(run_dir: Path, rewards: list[float], mode: str = "cells", events=(), loss=None) -> Path:
    """A run directory as the trainer leaves it: config.yaml, and metrics/events through JsonlLogger.

    With ``mode="cells"``, cell 1 dies during step 2 (cell 0 trains the whole batch) and is back at step 3.
    """
    run_dir.mkdir(parents=True)
    dp = {"mode": mode, "num_cells": 2, "size": 2}
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"dp": dp, "split": {"name": "delayed"}}))
    logger = JsonlLogger(run_dir)
    prefix = "cell" if mode == "cells" else "dp"
    for step, reward in enumerate(rewards):
        metrics = {"reward/mean": reward, "reward/std": 0.1, "loss": loss[step] if loss else -0.01 * step,
                   "time/elapsed": 10.0 * (step + 1)}
        alive = [0] if mode == "cells" and step == 2 else [0, 1]
        for replica in alive:
            metrics[f"{prefix}/{replica}/num_samples"] = 32 // len(alive)
            metrics[f"{prefix}/{replica}/num_tokens"] = 100 // len(alive)
        if mode == "cells":
            metrics.update({"cells/alive": len(alive), "ft/quorum_id": 1 if step < 2 else step, "ft/failures": 0,
                            "ft/goodput": 3.2, "ft/ettr": 0.9 if step < 2 else 0.8})
            if step >= 2:
                metrics["ft/mttr_last_s"] = 0.4
        logger.log(metrics, step)
    for kind, step, fields in events:
        logger.event(kind, step, **fields)
    logger.finish()
    return run_dir


FAULT_EVENTS = [
    ("quorum_change", 0, {"old": None, "new": 1, "participants": 2}),
    ("cell_failed", 2, {"cell": 1, "incarnation": 0, "phase": "mid_forward_backward", "reason": "SIGKILL"}),
    ("cell_replacement_started", 2, {"cell": 1, "incarnation": 1}),
    ("resplit", 2, {"minibatch": 0, "attempts": 2, "participants": 1}),
    ("quorum_change", 2, {"old": 1, "new": 2, "participants": 1}),
    ("cell_joined", 3, {"cell": 1, "incarnation": 1}),
    ("heal", 3, {"cell": 1, "heal_time": 0.4, "quorum_id": 3}),
    ("quorum_change", 3, {"old": 2, "new": 3, "participants": 2}),
]


def run_report(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfw.report", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def check_png(path: Path, figsize) -> None:
    with Image.open(path) as image:
        image.verify()  # a complete, uncorrupted PNG
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (round(figsize[0] * DPI), round(figsize[1] * DPI))


def panels(sidecar: Path) -> dict[str, dict]:
    return {panel["title"]: panel for panel in json.loads(sidecar.read_text())["panels"]}


def test_cells_run_with_a_failure_and_a_heal(tmp_path):
    run_dir = write_run(tmp_path / "run", [0.1, 0.2, 0.3, 0.4, 0.5], events=FAULT_EVENTS)
    result = run_report(run_dir, "--out", tmp_path / "report")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path / "report" / "run.png"), str(tmp_path / "report" / "run.json")]

    check_png(tmp_path / "report" / "run.png", RUN_FIGSIZE)
    shown = panels(tmp_path / "report" / "run.json")
    assert list(shown) == RUN_PANELS
    assert shown["Reward (mean ± std)"]["series"] == ["reward/mean", "± reward/std"]
    assert shown["Samples per replica"]["series"] == ["cell/0", "cell/1"]
    assert shown["Response tokens per replica"]["series"] == ["cell/0", "cell/1"]
    assert shown["Alive cells and quorum id"]["series"] == ["cells/alive", "ft/quorum_id"]
    # one row per kind, in order of first occurrence
    assert shown["Events"]["series"] == ["quorum_change", "cell_failed", "cell_replacement_started", "resplit",
                                         "cell_joined", "heal"]
    assert shown["Goodput and ETTR"]["series"] == ["ft/goodput", "ft/ettr", "failures at steps [2]"]
    assert shown["MTTR of the last failure"]["series"] == ["ft/mttr_last_s", "failures at steps [2]"]
    assert all(panel["note"] is None for panel in shown.values())
    # the bars: at step 2 cell 1 is dead (it trained nothing there: 0) and cell 0 carries the whole batch
    run = load_run(run_dir)
    assert run.replica_series("num_samples") == {"cell/0": [16, 16, 32, 16, 16], "cell/1": [16, 16, 0, 16, 16]}
    assert run.replica_series("num_tokens") == {"cell/0": [50, 50, 100, 50, 50], "cell/1": [50, 50, 0, 50, 50]}


def test_classic_run_without_events_has_an_empty_timeline(tmp_path):
    run_dir = write_run(tmp_path / "run", [0.1, 0.2, 0.3], mode="classic", loss=[0.5, float("nan"), 0.25])
    result = run_report(run_dir)  # default output: <run>/report
    assert result.returncode == 0, result.stderr

    check_png(run_dir / "report" / "run.png", RUN_FIGSIZE)
    shown = panels(run_dir / "report" / "run.json")
    assert shown["Samples per replica"]["series"] == ["dp/0", "dp/1"]
    assert shown["Events"] == {"title": "Events", "series": [],
                               "note": "no events recorded (events.jsonl is absent or empty)"}
    assert shown["Alive cells and quorum id"]["series"] == []
    assert "classic run" in shown["Alive cells and quorum id"]["note"]
    assert shown["Goodput and ETTR"]["note"] == "no ft/goodput in metrics.jsonl"
    assert shown["Loss"]["note"] == "non-finite at steps [1]"  # written as "nan" by JsonlLogger, still shown
    assert not (run_dir / "report" / "episodes.md").exists()  # one-turn episodes, no tools: nothing to say


def test_episodes_table_of_a_run_with_tools(tmp_path):
    from rlfw.report.load import Run
    from rlfw.report.summary import episode_table, has_episodes

    common = {"rollout/num_samples": 4, "env/turns_max": 2, "env/token_limit_episodes": 0}
    rows = [{"step": 0, **common, "env/turns_mean": 1.5, "env/truncated_episodes": 1, "env/turn_limit_episodes": 1,
             "env/tool_calls/calc": 2, "env/tool_errors/calc": 1, "env/tool_seconds": 0.5, "env/share": 0.2},
            {"step": 1, **common, "env/turns_mean": 2.0, "env/truncated_episodes": 0, "env/turn_limit_episodes": 0,
             "env/tool_calls/calc": 4, "env/tool_errors/calc": 0, "env/tool_calls/unknown": 1,
             "env/tool_errors/unknown": 1, "env/tool_seconds": 1.0, "env/share": 0.4}]
    assert not has_episodes(Run(tmp_path, [{"step": 0, "env/turns_mean": 1.0, "env/turns_max": 1}]))
    assert has_episodes(Run(tmp_path, rows))
    assert episode_table(Run(tmp_path, rows)).splitlines()[2:] == [
        "| steps | 2 |",
        "| turns per episode (mean, max) | 1.75, 2 |",
        "| truncated episodes (turn limit, token limit) | 1 (1, 0) |",
        "| tool `calc`: calls, errors | 6, 1 (16.7%) |",
        "| tool `unknown`: calls, errors | 1, 1 (100.0%) |",
        "| tool seconds | 1.5 |",
        "| environment share of the rollout (mean) | 30.0% |",
    ]


def test_sweep_compares_jobs_and_lists_the_failed_one(tmp_path):
    sweep = tmp_path / "sweep"
    jobs = {"0_dp=classic,num_steps=12": [0.1] * 2 + [0.2] * 9 + [0.5], "1_dp=cells,num_steps=12": [0.0] * 11 + [0.9],
            "2_dp=cells,num_steps=12,rollout.top_p=0": None}
    for name, rewards in jobs.items():
        overrides = name.split("_", 1)[1].split(",")
        if rewards is None:  # failed before its first step, as a config error does
            (sweep / name).mkdir(parents=True)
            try:
                raise ValueError("rollout.top_p=0.0 must be in (0, 1]")
            except ValueError as error:
                write_failure(sweep / name, error, wall_s=3.5)
        else:
            write_run(sweep / name, rewards, mode=overrides[0].split("=")[1])
        (sweep / name / ".hydra").mkdir()
        (sweep / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (sweep / "multirun.yaml").write_text("hydra: {}\n")

    result = run_report(sweep, "--out", tmp_path / "report")
    assert result.returncode == 0, result.stderr

    check_png(tmp_path / "report" / "sweep.png", SWEEP_FIGSIZE)
    [panel] = json.loads((tmp_path / "report" / "sweep.json").read_text())["panels"]
    # labelled by what differs between jobs (num_steps=12 is common to all)
    assert panel["series"] == ["dp=classic", "dp=cells", "dp=cells,rollout.top_p=0 (failed)"]
    table = (tmp_path / "report" / "sweep_summary.md").read_text().splitlines()
    assert table[2:5] == [
        "| 0 | `dp=classic` | ok | 0.5000 | 0.2300 | 120.0 |  |",
        "| 1 | `dp=cells` | ok | 0.9000 | 0.0900 | 120.0 |  |",
        "| 2 | `dp=cells,rollout.top_p=0` | failed | – | – | 3.5 | ValueError: rollout.top_p=0.0 must be in (0, 1] |",
    ]
    assert table[-1] == "3 jobs, 1 failed."


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "metrics.jsonl: no such file"),
        ("", "metrics.jsonl: empty; the run logged no step"),
        ('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.5}\n{"step": 2, "loss": \n', "metrics.jsonl:3: not valid JSON"),
        ('{"step": 0}\n[1, 2]\n', "metrics.jsonl:2: expected a JSON object, got list"),
        ('{"loss": 1.0}\n', "metrics.jsonl:1: missing 'step'"),
        ('{"step": "zero"}\n', "metrics.jsonl:1: 'step' must be an integer"),
    ],
)
def test_bad_metrics_file_names_file_and_line(tmp_path, capsys, content, message):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if content is not None:
        (run_dir / "metrics.jsonl").write_text(content)
    assert main([str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlfw.report: error: ") and f"{run_dir}/{message}" in err
    assert not (run_dir / "report" / "run.png").exists()


def test_bad_events_line_is_named_too(tmp_path):
    run_dir = write_run(tmp_path / "run", [0.1, 0.2])
    with open(run_dir / "events.jsonl", "a") as file:
        file.write('{"step": 1, "kind": "heal"}\n{"step": 1}\n')
    result = run_report(run_dir)
    assert result.returncode == 1
    assert f"{run_dir}/events.jsonl:2: missing 'kind'" in result.stderr
