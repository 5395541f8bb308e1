"""The run directory's files, by name, and the one reader of its JSONL logs.

A run directory is read by other parts than the one that wrote it (a resumed job rewinds the step logs, the goodput
meter reads the kept steps back, the report draws them, a sweep collects each job's ``FAILED`` record), so every
name is spelt here once. The module imports nothing of rlfw: any layer may use it.
"""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"  # {"step", **metrics} per step (JsonlLogger)
EVENTS = "events.jsonl"  # {"step", "kind", "time", **fields}
TABLES = "tables.jsonl"  # {"step", "name", "columns", "rows"}
LEDGER = "ledger.jsonl"  # per step and role: the sample ids trained and the replicas' weight digests
STEP_LOGS = (METRICS, EVENTS, TABLES, LEDGER)  # what a resumed job rewinds to its checkpoint's step
REWOUND = ".rewound"  # suffix of the file a step log's superseded records move to
CONFIG = "config.yaml"  # the run's resolved config
RUN_STARTED = "run_started.json"  # the wall time the run's first job started
FAILED = "FAILED"  # a sweep job's error record
SWEEP_SUMMARY = "sweep_summary.json"  # at a sweep's top: every job's outcome
OUTCOME = "outcome.json"  # in each sweep job's .hydra/ directory

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class RecordError(ValueError):
    """A line of a JSONL log that is not a JSON object; the message names the file and the line."""


def read_jsonl(path: str | Path, required: tuple[str, ...] = (),
               check: Callable[[dict[str, Any]], str | None] | None = None) -> list[dict[str, Any]]:
    """Every non-blank line of a JSONL file as a dict, values as written. Strict, because a record silently
    skipped would make what is drawn or resumed from it wrong without saying so: a line that is not a JSON object,
    or lacks a key of ``required``, or for which ``check`` gives a message, raises RecordError naming the file
    and the line."""
    records = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise RecordError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise RecordError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            missing = [key for key in required if key not in record]
            if missing:
                raise RecordError(f"{path}:{number}: missing {', '.join(map(repr, missing))}")
            problem = check(record) if check is not None else None
            if problem:
                raise RecordError(f"{path}:{number}: {problem}")
            records.append(record)
    return records


def write_failure(run_dir: Path, error: BaseException, wall_s: float) -> Path:
    """Record why a job failed: ``FAILED`` holds a JSON object with the error's type and message, its root cause
    (``Type: first line``), traceback and the job's wall time."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cause = _root_cause(error)
    record = {
        "type": type(error).__name__,
        "message": str(error),
        "cause": f"{type(cause).__name__}: {_first_line(str(cause))}".rstrip(": "),
        "traceback": "".join(traceback.format_exception(error)),
        "wall_s": wall_s,
    }
    path = run_dir / FAILED
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def read_failure(run_dir: Path) -> dict[str, Any] | None:
    """The ``FAILED`` record of a run directory, or None if the run did not fail."""
    path = Path(run_dir) / FAILED
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:  # not ours (e.g. written by hand): keep its text as the message
        return {"type": "Failed", "message": path.read_text(encoding="utf-8").strip()}
    return record if isinstance(record, dict) else {"type": "Failed", "message": str(record)}


def describe_failure(failure: dict[str, Any]) -> str:
    """The root cause, or ``Type: first line of the message``: short enough for a table cell or a log line."""
    if failure.get("cause"):
        return failure["cause"]
    return f"{failure.get('type', 'Failed')}: {_first_line(failure.get('message', ''))}".rstrip(": ")


def _root_cause(error: BaseException) -> BaseException:
    """The exception raised inside a Ray actor or task, unwrapped from Ray's ``RayTaskError`` (its ``cause``)."""
    while isinstance(getattr(error, "cause", None), BaseException):
        error = error.cause
    return error


def _first_line(message: object) -> str:
    lines = _ANSI_ESCAPE.sub("", str(message)).strip().splitlines()  # Ray colours its errors
    return lines[0] if lines else ""
