"""Read W&B's local run files back, so tests can check what a run really recorded.

wandb 0.31 no longer ships a Python reader for its ``.wandb`` transaction log (the
old ``wandb.sdk.internal.datastore`` is gone; the file is written by the Go
``wandb-core`` service), so this module decodes the format itself:

* a 7-byte file header: ``b":W&B"``, magic ``0xBEE1`` (uint16 LE), version ``0``;
* then the LevelDB log layout: 32 KiB blocks of chunks, each chunk headed by
  CRC-32 (IEEE, over the type byte + payload, unmasked), uint16 LE length, type byte
  (1 full, 2 first, 3 middle, 4 last); a block tail shorter than a chunk header is
  zero padding;
* each reassembled payload is one serialized ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import logging
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wandb.proto import wandb_internal_pb2

log = logging.getLogger(__name__)
_FILE_HEADER = struct.Struct("<4sHB")
_FILE_IDENT, _FILE_MAGIC, _FILE_VERSION = b":W&B", 0xBEE1, 0
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK_SIZE = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_wandb_records(path: str | Path) -> Iterator[wandb_internal_pb2.Record]:
    """Yield every record of one ``run-*.wandb`` file, in write order.

    A chunk cut short at the end of the file (a run killed mid-write, or still
    running) ends the iteration quietly; a checksum mismatch raises ``ValueError``,
    because it means the file is corrupt rather than merely unfinished.
    """
    from wandb.proto import wandb_internal_pb2  # lazily: importing wandb takes about a second

    data = Path(path).read_bytes()
    if len(data) < _FILE_HEADER.size:
        return
    ident, magic, version = _FILE_HEADER.unpack_from(data)
    if (ident, magic, version) != (_FILE_IDENT, _FILE_MAGIC, _FILE_VERSION):
        raise ValueError(f"{path}: not a W&B transaction log (header {ident!r}, {magic:#x}, {version})")

    pos = _FILE_HEADER.size
    fragments: list[bytes] = []
    while True:
        if _BLOCK_SIZE - pos % _BLOCK_SIZE < _CHUNK_HEADER.size:
            pos += _BLOCK_SIZE - pos % _BLOCK_SIZE
        if pos + _CHUNK_HEADER.size > len(data):
            return
        checksum, length, chunk_type = _CHUNK_HEADER.unpack_from(data, pos)
        payload_start = pos + _CHUNK_HEADER.size
        payload = data[payload_start : payload_start + length]
        if len(payload) < length:
            return
        if zlib.crc32(payload, zlib.crc32(bytes([chunk_type]))) != checksum:
            raise ValueError(f"{path}: checksum mismatch in chunk at byte {pos}")
        if chunk_type in (_FULL, _FIRST):
            fragments = [payload]
        elif chunk_type in (_MIDDLE, _LAST):
            fragments.append(payload)
        else:
            raise ValueError(f"{path}: unknown chunk type {chunk_type} at byte {pos}")
        pos = payload_start + length
        if chunk_type in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(fragments))
            yield record


def read_wandb_offline_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """Return the history rows of every offline run under ``<run_dir>/wandb``.

    One dict per committed ``wandb.log`` step, keyed like the logged metrics and
    including W&B's own ``_step``, ``_runtime`` and ``_timestamp``.  Logged
    dicts and media (e.g. a ``wandb.Table``) come back as nested dicts.  A
    resumed run writes a new ``offline-run-*`` folder with the same id; folders are
    read in name order, which starts with their start time, so the rows of all its
    segments follow each other in time.
    """
    rows = []
    for path in sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        for record in iter_wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append(_history_row(record.history))
    return rows


def _history_row(history: wandb_internal_pb2.HistoryRecord) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for item in history.item:
        *parents, leaf = list(item.nested_key) or [item.key]
        target = row
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = _item_value(item)
    return row


def _item_value(item: wandb_internal_pb2.HistoryItem) -> Any:
    """Decode a history value; wandb-core fills ``value_json`` (NaN/inf as JSON5 tokens) or a typed field."""
    if item.value_json:
        return json.loads(item.value_json)
    kind = item.WhichOneof("value")
    if kind == "json":
        return json.loads(item.json)
    if kind in (None, "none"):
        return None
    return getattr(item, kind)


def wait_for_exit_record(path: Path, timeout_s: float) -> bool:
    """Whether the W&B transaction log at ``path`` holds its exit record within ``timeout_s`` (a warning if not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists() and any(r.WhichOneof("record_type") == "exit" for r in iter_wandb_records(path)):
            return True
        if time.monotonic() >= deadline:
            log.warning("W&B's file %s has no exit record %.0f s after the run finished: it may be incomplete",
                        path, timeout_s)
            return False
        time.sleep(0.05)
