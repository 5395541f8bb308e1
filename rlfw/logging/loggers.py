"""Metrics loggers: local JSONL files, Weights & Biases, and a console progress bar.

Every logger takes the same four calls (see ``Logger``), so the trainer talks to one
``MultiLogger`` built by ``build_loggers`` and never to a backend directly.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlsplit

from tqdm import tqdm

from rlfw.logging.wandb_files import wait_for_exit_record
from rlfw.run_files import EVENTS, METRICS, TABLES

Metrics = Mapping[str, float | int]


class Logger(Protocol):
    """What the trainer may report; each backend decides how to record it."""

    def log(self, metrics: Metrics, step: int) -> None:
        """Record scalar metrics of training step ``step``."""

    def event(self, kind: str, step: int, **fields: Any) -> None:
        """Record a discrete event (cell failure, re-split, heal, quorum change...) and its timings."""

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """Record a table, e.g. sample generations with their rewards."""

    def finish(self, exit_code: int = 0) -> None:
        """Flush and close; ``exit_code`` tells backends whether the run failed."""


class JsonlLogger:
    """Append-only JSON Lines files under ``run_dir``: the record that survives any crash.

    ``metrics.jsonl`` gets ``{"step", **metrics}``, ``events.jsonl`` gets
    ``{"step", "kind", "time", **fields}`` (``time`` in Unix seconds), ``tables.jsonl``
    gets ``{"step", "name", "columns", "rows"}``. Files are line-buffered, so every
    record reaches the OS as soon as it is written.

    Strict JSON has no NaN or infinity, and a diverging loss must neither crash the run
    nor lose its key, so non-finite floats are written as the strings ``"nan"``,
    ``"inf"`` and ``"-inf"`` (unlike ``null``, this keeps NaN and the sign of infinity
    apart). Values JSON cannot encode at all are written as their ``str()``.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[str]] = {}

    def log(self, metrics: Metrics, step: int) -> None:
        self._append(METRICS, {"step": step, **metrics})

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self._append(EVENTS, {"step": step, "kind": kind, "time": time.time(), **fields})

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self._append(TABLES, {"step": step, "name": name, "columns": columns, "rows": rows})

    def finish(self, exit_code: int = 0) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def _append(self, filename: str, record: dict[str, Any]) -> None:
        # Opened on first use, so a run without events or tables leaves no empty files.
        if filename not in self._files:
            self._files[filename] = open(self.run_dir / filename, "a", buffering=1, encoding="utf-8")
        line = json.dumps(_finite_json(record), allow_nan=False, default=str)
        self._files[filename].write(line + "\n")


def _finite_json(value: Any) -> Any:
    """Replace non-finite floats (also numpy's) by strings, recursing into containers."""
    if isinstance(value, bool | str | None):
        return value
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        number = float(value)
        if math.isnan(number):
            return "nan"
        if math.isinf(number):
            return "inf" if number > 0 else "-inf"
        return number
    if isinstance(value, Mapping):
        return {str(key): _finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(item) for item in value]
    return value


class WandbLogger:
    """Weights & Biases run, online when credentials exist and offline otherwise.

    ``mode="auto"`` honours ``WANDB_MODE`` if set, else goes online when ``WANDB_API_KEY``
    is set or the netrc file holds a key for the W&B host, else offline. Offline runs
    write ``<run_dir>/wandb/offline-run-*/run-<id>.wandb`` (upload later with
    ``wandb sync``; read back with ``read_wandb_offline_history``).

    Pass the ``run_id`` saved from an earlier run (``.run_id``) to continue it. wandb is
    imported on first use because importing it costs about a second and only this
    logger needs it.
    """

    # Rewards, per-cell and per-rank batch sizes, membership and fault-tolerance metrics
    # are plotted against the trainer step, so their charts line up with the training
    # curves; each glob is its own dashboard section, one chart per key (cell/0/...,
    # cell/1/... side by side).
    STEP_METRIC = "trainer/step"
    STEPPED_GLOBS = ("reward/*", "cell/*", "dp/*", "cells/*", "ft/*")
    EVENTS_TABLE_KEY = "event_log"
    OFFLINE_BASE_URL = "http://127.0.0.1:9"
    FINISH_WAIT_S = 30.0

    def __init__(
        self,
        run_dir: str | Path,
        project: str,
        group: str | None = None,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        mode: str = "auto",
        tags: Sequence[str] | None = None,
    ) -> None:
        import wandb

        mode = _resolve_wandb_mode(mode)
        settings: dict[str, str] = {}
        if mode == "offline":
            # The discard port of localhost: should any code path still try to reach the
            # server, it fails at once, without a DNS lookup or data leaving the machine.
            # Set in the environment so the wandb-core service process inherits it too.
            os.environ.setdefault("WANDB_BASE_URL", self.OFFLINE_BASE_URL)
            # Nobody reads an offline run's captured console, and wrapping stderr under
            # the console logger's progress bar only duplicates output.
            settings["console"] = "off"
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            dir=run_dir,
            project=project,
            group=group,
            name=name,
            config=dict(config or {}),
            tags=list(tags) if tags else None,
            mode=mode,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(**settings),
        )
        self.run_id: str = self._run.id
        self._offline = mode == "offline"
        self._run.define_metric(self.STEP_METRIC)
        for glob in self.STEPPED_GLOBS:
            self._run.define_metric(glob, step_metric=self.STEP_METRIC)
        self._last_step = 0
        self._event_counts: Counter[str] = Counter()
        # INCREMENTAL: each log uploads only the rows added since the last one, so the
        # growing event history is not re-uploaded (plain tables are immutable).
        self._events_table = wandb.Table(columns=["step", "kind", "time", "fields"], log_mode="INCREMENTAL")

    def log(self, metrics: Metrics, step: int) -> None:
        self._log({**metrics, self.STEP_METRIC: step}, step)

    def event(self, kind: str, step: int, **fields: Any) -> None:
        """Count the event, chart its numeric fields, and add a row to the event table."""
        self._event_counts[kind] += 1
        row = {f"events/{kind}": self._event_counts[kind]}
        row.update(
            (f"events/{kind}/{field}", value)
            for field, value in fields.items()
            if isinstance(value, Real) and not isinstance(value, bool)
        )
        self._events_table.add_data(step, kind, time.time(), json.dumps(fields, default=str))
        self._log({**row, self.EVENTS_TABLE_KEY: self._events_table}, step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        import wandb

        self._log({name: wandb.Table(columns=columns, data=rows)}, step)

    def finish(self, exit_code: int = 0) -> None:
        """End the run. Offline, ``run.finish`` can return before W&B's service has written the run's file (seen:
        7 bytes of it, no record, when finish returned; whole 2 s later); a report or a resumed job that reads it
        at once would miss the run's last rows, so this waits for the file's exit record (at most
        ``FINISH_WAIT_S``, then says the file may be incomplete)."""
        self._run.finish(exit_code=exit_code)
        if self._offline:
            wait_for_exit_record(Path(self._run.settings.sync_file), self.FINISH_WAIT_S)

    def _log(self, data: dict[str, Any], step: int) -> None:
        # wandb silently drops data logged at a step below its current one; an event
        # noticed late (e.g. a cell failure found after the next step was logged) is
        # filed under the current step instead. Its true step stays in the event table.
        self._last_step = max(self._last_step, step)
        self._run.log(data, step=self._last_step)


_WANDB_MODES = ("auto", "online", "offline", "disabled")


def _resolve_wandb_mode(mode: str) -> str:
    if mode not in _WANDB_MODES:
        raise ValueError(f"unknown wandb mode {mode!r}; valid modes: {', '.join(_WANDB_MODES)}")
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY") or _netrc_has_wandb_key():
        return "online"
    return "offline"


def _netrc_has_wandb_key() -> bool:
    """Whether ``wandb login`` stored a key for the configured W&B host."""
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC", "~/.netrc")).expanduser()
    try:
        return host is not None and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class ConsoleLogger:
    """One line per step: reward, loss, samples, each replica's share of them, and with cells how many are alive
    and the quorum id; events are printed as they come.

    On a terminal the line is a tqdm progress bar redrawn in place, with events above it; off one (CI logs,
    redirected stderr) every step is its own plain line, so a log reads as a table.
    """

    SHARE = re.compile(r"(cell|dp)/(\d+)/num_samples")

    def __init__(self, total_steps: int, stream: IO[str] | None = None) -> None:
        self._stream = stream or sys.stderr
        self._total = total_steps
        self._bar = None
        if self._stream.isatty():
            self._bar = tqdm(total=total_steps, file=self._stream, unit="step", dynamic_ncols=True, mininterval=0.1)

    @classmethod
    def progress(cls, metrics: Metrics) -> dict[str, Any]:
        """The step's figures on the progress line, e.g. reward=0.512 loss=-0.031 samples=64 shares=33+31
        cells=2 quorum=3 (shares: the samples each cell or classic rank trained, in replica order)."""
        line: dict[str, Any] = {}
        if "reward/mean" in metrics:
            line["reward"] = f"{metrics['reward/mean']:.3f}"
        if "loss" in metrics:
            line["loss"] = f"{metrics['loss']:.4g}"
        if "train/num_samples" in metrics:
            line["samples"] = int(metrics["train/num_samples"])
        shares = sorted((int(m.group(2)), int(v)) for k, v in metrics.items() if (m := cls.SHARE.fullmatch(k)))
        if shares:
            line["shares"] = "+".join(str(n) for _, n in shares)
        if "cells/alive" in metrics:
            line["cells"] = int(metrics["cells/alive"])
        if metrics.get("ft/quorum_id", -1) >= 0:
            line["quorum"] = int(metrics["ft/quorum_id"])
        return line

    def log(self, metrics: Metrics, step: int) -> None:
        line = self.progress(metrics)
        if self._bar is None:
            figures = " ".join(f"{key}={value}" for key, value in line.items())
            print(f"step {step} ({step + 1}/{self._total}) {figures}".rstrip(), file=self._stream, flush=True)
            return
        if line:
            self._bar.set_postfix(line, refresh=False)  # the update below redraws, rate-limited by mininterval
        if step + 1 > self._bar.n:  # the bar counts completed steps
            self._bar.update(step + 1 - self._bar.n)

    def event(self, kind: str, step: int, **fields: Any) -> None:
        details = " ".join(f"{field}={_short(value)}" for field, value in fields.items())
        text = f"[step {step}] {kind} {details}".rstrip()
        if self._bar is None:
            print(text, file=self._stream, flush=True)
        else:
            self._bar.write(text, file=self._stream)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """Tables are too wide for a terminal; the other loggers keep them."""

    def finish(self, exit_code: int = 0) -> None:
        if self._bar is not None:
            self._bar.close()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class MultiLogger:
    """Fans every call out to several loggers.

    A failing logger must not cost the others their data: every logger is called, then
    the error is re-raised (several errors as an ``ExceptionGroup``).
    """

    def __init__(self, loggers: Sequence[Logger]) -> None:
        self.loggers = list(loggers)

    @property
    def run_id(self) -> str | None:
        """The W&B run id, if a W&B logger is among them (saved in checkpoints so a resumed run continues it)."""
        return next((logger.run_id for logger in self.loggers if isinstance(logger, WandbLogger)), None)

    def log(self, metrics: Metrics, step: int) -> None:
        self._fan_out("log", metrics, step)

    def event(self, kind: str, step: int, **fields: Any) -> None:
        self._fan_out("event", kind, step, **fields)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self._fan_out("table", name, columns, rows, step)

    def finish(self, exit_code: int = 0) -> None:
        self._fan_out("finish", exit_code)

    def reopen_files(self) -> None:
        """Close the JSONL files; the next record opens them again (a rewind replaced them under the handles)."""
        for logger in self.loggers:
            if isinstance(logger, JsonlLogger):
                logger.finish()

    def _fan_out(self, method: str, *args: Any, **kwargs: Any) -> None:
        errors = []
        for logger in self.loggers:
            try:
                getattr(logger, method)(*args, **kwargs)
            except Exception as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup(f"{len(errors)} loggers failed in {method}()", errors)


LOGGER_NAMES = ("jsonl", "wandb", "console")


def build_loggers(
    names: Sequence[str],
    run_dir: str | Path,
    total_steps: int,
    wandb_kwargs: Mapping[str, Any] | None = None,
) -> MultiLogger:
    """Build the loggers named in ``names`` (a subset of ``LOGGER_NAMES``).

    All names are checked before any logger starts, so a typo cannot leave a half-made
    W&B run behind. ``wandb_kwargs`` go to ``WandbLogger`` (``project`` is required).
    """
    unknown = [name for name in names if name not in LOGGER_NAMES]
    if unknown:
        raise ValueError(f"unknown logger(s) {', '.join(map(repr, unknown))}; valid loggers: {', '.join(LOGGER_NAMES)}")
    loggers: list[Logger] = []
    for name in dict.fromkeys(names):
        if name == "jsonl":
            loggers.append(JsonlLogger(run_dir))
        elif name == "wandb":
            loggers.append(WandbLogger(run_dir, **(wandb_kwargs or {})))
        else:
            loggers.append(ConsoleLogger(total_steps))
    return MultiLogger(loggers)
