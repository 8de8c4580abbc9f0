"""The offline W&B run files a training run leaves in <run>/wandb, read back for the tests: what
the run logged to W&B (its history rows) and the config it recorded.

A .wandb file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0) then
LevelDB-log framing: 32 KiB blocks of records, each with a 7-byte header (crc32c, length,
type: 1 full, 2 first, 3 middle, 4 last) whose payloads are wandb_internal_pb2.Record protobufs.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmsys.core.rundir import WANDB_DIR

_WANDB_HEADER = 7
_BLOCK = 32768
_RECORD_HEADER = 7


def wandb_records(path: str | Path) -> Iterator[Any]:
    """The protobuf Records of an offline run's .wandb file (parsed with W&B's own schema)."""
    from wandb.proto import wandb_internal_pb2  # W&B's import takes a second: tests that read pay it

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    pos, pending = _WANDB_HEADER, b""
    while pos + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, rtype = struct.unpack("<IHB", data[pos : pos + _RECORD_HEADER])
        pos += _RECORD_HEADER
        if pos + length > len(data):  # the tail of a run killed mid-write
            break
        payload, pos = data[pos : pos + length], pos + length
        if rtype == 0 and length == 0:  # zero padding
            continue
        if rtype == 1:
            pending = b""
            chunk = payload
        elif rtype == 2:
            pending = payload
            continue
        elif rtype == 3:
            pending += payload
            continue
        elif rtype == 4:
            chunk, pending = pending + payload, b""
        else:
            break
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(chunk)
        except Exception:  # a damaged record: stop reading, as W&B's own reader does
            break
        yield record


def wandb_files(run_dir: str | Path) -> list[Path]:
    """The offline W&B run files under run_dir/wandb, one per attempt, oldest first."""
    return sorted(Path(run_dir, WANDB_DIR).glob("*run-*/run-*.wandb"))


def wandb_history(run_dir: str | Path, attempt: int | None = None) -> list[dict[str, Any]]:
    """Every history row logged to the offline W&B run(s) under run_dir/wandb, oldest first; with
    `attempt`, only those of that file of `wandb_files` (-1: the latest attempt's)."""
    rows = []
    files = wandb_files(run_dir)
    for path in files if attempt is None else [files[attempt]]:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {}
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    row[key] = json.loads(item.value_json)
                rows.append(row)
    return rows


def wandb_config(run_dir: str | Path) -> dict[str, Any]:
    """The config the offline W&B run(s) recorded (later updates win)."""
    config: dict[str, Any] = {}
    for path in wandb_files(run_dir):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            items = []
            if kind == "run":
                items = record.run.config.update
            elif kind == "config":
                items = record.config.update
            for item in items:
                key = item.key or "/".join(item.nested_key)
                config[key] = json.loads(item.value_json)
    return config
