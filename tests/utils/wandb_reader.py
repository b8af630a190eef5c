"""Read logged history back from an offline wandb run file (no wandb API needed for reading).

Format (wandb's LevelDB-style log): the file starts with a 7-byte header (b":W&B", version); then 32 KiB
blocks of records, each record prefixed by a 7-byte header <IHB (crc32, length, type); type 1 = full record,
2/3/4 = first/middle/last fragment; a zero-length type-0 header or fewer than 7 bytes left pads to the block's end.
Each assembled record is a `wandb_internal_pb2.Record`; history records hold items (key, value_json).
"""

from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32 * 1024
HEADER = 7


def _records(data: bytes):
    pos, pending = HEADER, b""  # skip the file header
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        if kind == 0 and length == 0:
            pos += left_in_block - HEADER
            continue
        chunk = data[pos : pos + length]
        pos += length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def _history(path: str) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    rows = []
    for raw in _records(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def read_wandb_history(run_dir: str) -> list[dict]:
    """Every history row logged to the offline run(s) under run_dir/wandb, oldest run first.

    A resumed run gets a new directory, offline-run-<second>-<id>, and wandb appends -1, -2, ... when that
    name exists (a resume within the same second), so names do not sort in time order ("...-id-1/" sorts
    before "...-id/"); runs are ordered by their first row's `_timestamp` instead. Rows keep wandb's own
    `_step`, `_runtime` and `_timestamp` keys beside the logged ones.
    """
    runs = [_history(path) for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))]
    runs.sort(key=lambda rows: rows[0].get("_timestamp", float("inf")) if rows else float("inf"))
    return [row for rows in runs for row in rows]
