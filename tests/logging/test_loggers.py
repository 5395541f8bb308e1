import json
import math
import os
import threading
import time
from pathlib import Path

import pytest

from rlfw.logging import (
    ConsoleLogger,
    JsonlLogger,
    MultiLogger,
    WandbLogger,
    build_loggers,
    iter_wandb_records,
    read_wandb_offline_history,
)
from rlfw.logging.loggers import _resolve_wandb_mode
from rlfw.logging.wandb_files import wait_for_exit_record
from rlfw.run_files import read_jsonl


def _isolate_wandb(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """No credentials, no network, nothing written outside ``home``."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    # setenv first so that the undo also removes the value WandbLogger sets.
    monkeypatch.setenv("WANDB_BASE_URL", "unset")
    monkeypatch.delenv("WANDB_BASE_URL")
    monkeypatch.setenv("NETRC", str(home / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    _isolate_wandb(monkeypatch, tmp_path / "wandb-home")


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """One offline W&B run shared by the read-back tests (each run costs about a second)."""
    root = tmp_path_factory.mktemp("offline")
    run_dir = root / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        _isolate_wandb(monkeypatch, root / "wandb-home")
        logger = WandbLogger(run_dir, project="rlfw-test", group="g", name="n", config={"lr": 1e-6}, tags=["t"])
        base_url = os.environ.get("WANDB_BASE_URL")
        logger.log({"reward/mean": 0.25, "cell/0/num_samples": 8, "loss": float("nan")}, step=1)
        logger.log({"reward/mean": 0.5, "cell/0/num_samples": 6, "dp/size": 4}, step=2)
        logger.event("cell_failure", step=2, cell=0, detect_s=1.5, reason="timeout")
        logger.event("heal", step=1, heal_s=3.0)  # reported late: must not be dropped
        logger.table("samples", ["prompt", "reward"], [["2+2?", 1.0]], step=2)
        logger.log({"reward/mean": 0.75}, step=3)
        logger.finish()
    return run_dir, logger.run_id, base_url


# --- JsonlLogger ---------------------------------------------------------------------------


def test_jsonl_metrics_reach_disk_before_finish(tmp_path):
    logger = JsonlLogger(tmp_path)
    logger.log({"reward/mean": 0.5, "cells/alive": 4}, step=1)
    logger.log({"reward/mean": 0.75}, step=2)

    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.5, "cells/alive": 4},
        {"step": 2, "reward/mean": 0.75},
    ]
    assert not (tmp_path / "events.jsonl").exists()
    logger.finish()


def test_jsonl_non_finite_values_are_strict_json_strings(tmp_path):
    logger = JsonlLogger(tmp_path)
    logger.log({"loss": float("nan"), "grad_norm": float("inf"), "kl": -math.inf, "ok": 1.0}, step=3)
    logger.event("oom", step=3, wait_s=float("nan"), shards=[1.0, float("inf")])
    logger.finish()

    def reject(token):
        raise AssertionError(f"non-standard JSON token {token}")

    for name in ("metrics.jsonl", "events.jsonl"):
        for line in (tmp_path / name).read_text().splitlines():
            json.loads(line, parse_constant=reject)
    [metrics] = read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics == {"step": 3, "loss": "nan", "grad_norm": "inf", "kl": "-inf", "ok": 1.0}
    [event] = read_jsonl(tmp_path / "events.jsonl")
    assert event["wait_s"] == "nan" and event["shards"] == [1.0, "inf"]


def test_jsonl_events_and_tables(tmp_path):
    logger = JsonlLogger(tmp_path)
    before = time.time()
    logger.event("resplit", step=5, old_cells=4, new_cells=3, resplit_s=2.5)
    logger.table("samples", ["prompt", "response", "reward"], [["hi", "hello", 1.0], ["a", "b", 0.0]], step=5)
    logger.finish()

    [event] = read_jsonl(tmp_path / "events.jsonl")
    assert before <= event.pop("time") <= time.time()
    assert event == {"step": 5, "kind": "resplit", "old_cells": 4, "new_cells": 3, "resplit_s": 2.5}
    assert read_jsonl(tmp_path / "tables.jsonl") == [
        {
            "step": 5,
            "name": "samples",
            "columns": ["prompt", "response", "reward"],
            "rows": [["hi", "hello", 1.0], ["a", "b", 0.0]],
        }
    ]


# --- WandbLogger ---------------------------------------------------------------------------


def test_wandb_offline_run_file_holds_logged_history(offline_run):
    run_dir, run_id, base_url = offline_run
    assert base_url == WandbLogger.OFFLINE_BASE_URL
    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.name == f"run-{run_id}.wandb"

    rows = read_wandb_offline_history(run_dir)
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert rows[0]["reward/mean"] == 0.25 and rows[0]["cell/0/num_samples"] == 8
    assert math.isnan(rows[0]["loss"])
    assert rows[1]["dp/size"] == 4 and rows[1]["trainer/step"] == 2
    assert rows[1]["events/cell_failure"] == 1 and rows[1]["events/cell_failure/detect_s"] == 1.5
    assert "events/cell_failure/reason" not in rows[1]  # text fields live in the event table only
    assert rows[1]["events/heal/heal_s"] == 3.0  # late event filed under the current step
    assert rows[1]["event_log"]["log_mode"] == "INCREMENTAL"
    assert rows[1]["samples"]["_type"] == "table-file"
    assert rows[2]["reward/mean"] == 0.75


def test_wandb_defines_trainer_step_axis(offline_run):
    run_dir, _, _ = offline_run
    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(iter_wandb_records(run_file))
    axes = {r.metric.glob_name: r.metric.step_metric for r in records if r.HasField("metric") and r.metric.glob_name}
    assert axes == {glob: "trainer/step" for glob in ("reward/*", "cell/*", "dp/*", "cells/*", "ft/*")}
    [run_record] = [r.run for r in records if r.HasField("run")]
    assert (run_record.project, run_record.run_group, run_record.display_name) == ("rlfw-test", "g", "n")
    assert list(run_record.tags) == ["t"]


def test_wandb_event_table_holds_every_event(offline_run):
    """Events reach the dashboard as rows of one incremental table, late ones with their true step."""
    run_dir, _, _ = offline_run
    logged = [row["event_log"] for row in read_wandb_offline_history(run_dir) if "event_log" in row]
    assert [(entry["_type"], entry["nrows"]) for entry in logged] == [("incremental-table-file", 2)]
    [files_dir] = (run_dir / "wandb").glob("offline-run-*/files")
    increments = [json.loads(path.read_text()) for path in files_dir.glob("media/table/event_log_*.table.json")]
    assert {tuple(table["columns"]) for table in increments} == {("step", "kind", "time", "fields")}
    rows = sorted((row for table in increments for row in table["data"]), key=lambda row: row[2])
    assert [(step, kind, json.loads(fields)) for step, kind, _, fields in rows] == [
        (2, "cell_failure", {"cell": 0, "detect_s": 1.5, "reason": "timeout"}),
        (1, "heal", {"heal_s": 3.0}),
    ]


def test_wandb_reader_tolerates_truncated_tail_and_rejects_corruption(offline_run, tmp_path):
    run_dir, _, _ = offline_run
    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    full = list(iter_wandb_records(run_file))

    truncated = tmp_path / "truncated.wandb"
    truncated.write_bytes(data[: len(data) - 10])
    assert len(list(iter_wandb_records(truncated))) == len(full) - 1

    corrupt = tmp_path / "corrupt.wandb"
    corrupt.write_bytes(data[:20] + bytes([data[20] ^ 0xFF]) + data[21:])
    with pytest.raises(ValueError, match="checksum"):
        list(iter_wandb_records(corrupt))


def test_wandb_resumed_run_keeps_id_and_history(wandb_env, tmp_path):
    first = WandbLogger(tmp_path, project="rlfw-test", run_id="resume-me")
    first.log({"reward/mean": 0.1}, step=1)
    first.finish()
    second = WandbLogger(tmp_path, project="rlfw-test", run_id="resume-me")
    second.log({"reward/mean": 0.2}, step=2)
    second.finish(exit_code=1)

    assert first.run_id == second.run_id == "resume-me"
    run_files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [path.name for path in run_files] == ["run-resume-me.wandb"] * 2
    rows = read_wandb_offline_history(tmp_path)
    assert [(row["_step"], row["reward/mean"]) for row in rows] == [(1, 0.1), (2, 0.2)]
    [exit_record] = [r.exit for r in iter_wandb_records(run_files[1]) if r.HasField("exit")]
    assert exit_record.exit_code == 1



def test_finish_waits_for_the_run_files_exit_record(offline_run, tmp_path, caplog):
    """W&B's service can still be writing a run's file when ``run.finish`` returns: finish waits until the file ends
    with its exit record, and says so when it never does."""
    run_dir, run_id, _ = offline_run
    [done] = (run_dir / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")
    whole = done.read_bytes()
    growing = tmp_path / "run-growing.wandb"
    growing.write_bytes(whole[:7])  # what a reader found right after finish once: the header only
    threading.Timer(0.3, growing.write_bytes, args=(whole,)).start()
    started = time.monotonic()
    assert wait_for_exit_record(growing, timeout_s=30)
    assert time.monotonic() - started >= 0.3
    assert [r.exit.exit_code for r in iter_wandb_records(growing) if r.HasField("exit")] == [0]

    cut = tmp_path / "run-cut.wandb"
    cut.write_bytes(whole[: len(whole) // 2])
    assert not wait_for_exit_record(cut, timeout_s=0.2)
    assert "no exit record" in caplog.text and str(cut) in caplog.text

def test_wandb_auto_mode(monkeypatch, tmp_path):
    _isolate_wandb(monkeypatch, tmp_path)
    assert _resolve_wandb_mode("auto") == "offline"

    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert _resolve_wandb_mode("auto") == "online"

    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert _resolve_wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert _resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert _resolve_wandb_mode("auto") == "disabled"
    assert _resolve_wandb_mode("offline") == "offline"
    with pytest.raises(ValueError, match="'cloud'.*auto, online, offline, disabled"):
        _resolve_wandb_mode("cloud")


# --- ConsoleLogger, MultiLogger, build_loggers ---------------------------------------------


def test_console_logger_without_tty(capsys):
    logger = ConsoleLogger(total_steps=3)  # pytest's captured stderr is not a TTY
    logger.log({"reward/mean": 0.5, "loss": 1.25, "cells/alive": 2, "other": 7, "train/num_samples": 64,
                "cell/0/num_samples": 33, "cell/1/num_samples": 31, "ft/quorum_id": 1}, step=0)
    logger.event("cell_failure", step=1, cell=2, detect_s=0.123456)
    logger.table("samples", ["a"], [[1]], step=1)
    logger.log({"reward/mean": 0.75, "loss": 1.0, "cells/alive": 1, "train/num_samples": 64,
                "cell/10/num_samples": 60, "cell/2/num_samples": 4, "ft/quorum_id": 2}, step=1)
    logger.log({"reward/mean": 0.8, "loss": 0.5, "train/num_samples": 64, "dp/0/num_samples": 32,
                "dp/1/num_samples": 32}, step=2)
    logger.finish()

    assert capsys.readouterr().err.splitlines() == [
        "step 0 (1/3) reward=0.500 loss=1.25 samples=64 shares=33+31 cells=2 quorum=1",
        "[step 1] cell_failure cell=2 detect_s=0.1235",
        "step 1 (2/3) reward=0.750 loss=1 samples=64 shares=4+60 cells=1 quorum=2",  # replica order, not string order
        "step 2 (3/3) reward=0.800 loss=0.5 samples=64 shares=32+32",
    ]


def test_console_logger_on_a_terminal_draws_one_bar():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    logger = ConsoleLogger(total_steps=2, stream=terminal)
    logger.log({"reward/mean": 0.5, "cell/0/num_samples": 8, "cell/1/num_samples": 8, "cells/alive": 2}, step=0)
    logger.event("heal", step=1, cell=1)
    logger.log({"reward/mean": 0.25, "cell/0/num_samples": 16, "cells/alive": 1}, step=1)
    logger.finish()
    final = terminal.getvalue().rstrip().rsplit("\r", 1)[-1]
    assert "2/2" in final and "reward=0.250" in final and "shares=16" in final and "cells=1" in final
    assert "[step 1] heal cell=1\n" in terminal.getvalue()


class _Recorder:
    def __init__(self):
        self.calls = []

    def log(self, metrics, step):
        self.calls.append(("log", dict(metrics), step))

    def event(self, kind, step, **fields):
        self.calls.append(("event", kind, step, fields))

    def table(self, name, columns, rows, step):
        self.calls.append(("table", name, step))

    def finish(self, exit_code=0):
        self.calls.append(("finish", exit_code))


class _Broken(_Recorder):
    def log(self, metrics, step):
        raise RuntimeError("disk full")


def test_multi_logger_calls_every_logger_before_reraising():
    before, after = _Recorder(), _Recorder()
    logger = MultiLogger([before, _Broken(), after])

    with pytest.raises(RuntimeError, match="disk full"):
        logger.log({"loss": 1.0}, step=4)
    logger.event("heal", step=4, heal_s=2.0)
    logger.finish(exit_code=1)

    expected = [("log", {"loss": 1.0}, 4), ("event", "heal", 4, {"heal_s": 2.0}), ("finish", 1)]
    assert before.calls == after.calls == expected

    with pytest.raises(ExceptionGroup) as group:
        MultiLogger([_Broken(), _Broken()]).log({"loss": 1.0}, step=5)
    assert len(group.value.exceptions) == 2


def test_build_loggers(tmp_path, capsys):
    logger = build_loggers(["jsonl", "console"], tmp_path, total_steps=2)
    assert [type(each) for each in logger.loggers] == [JsonlLogger, ConsoleLogger]
    logger.log({"loss": 0.5}, step=1)
    logger.finish()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.5}]

    with pytest.raises(ValueError, match="'tensorboard'.*jsonl, wandb, console"):
        build_loggers(["jsonl", "tensorboard"], tmp_path, total_steps=2)
