"""Read the records of an offline wandb run file (``run-*.wandb``) in tests.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB
blocks of chunks, each with a 7-byte header (crc32, length, type: full/first/middle/last), the
chunks of one record holding one serialized ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a wandb run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # the writer pads the tail of a block
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def summary_and_history(path: Path) -> tuple[dict, list[dict]]:
    """The last summary values and every history row of a run file."""
    summary: dict = {}
    history: list[dict] = []
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                summary[key] = json.loads(item.value_json)
        elif kind == "history":
            history.append(
                {
                    (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return summary, history
