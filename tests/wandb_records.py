"""Read what W&B wrote for an offline run: the records of its ``run-ID.wandb`` transaction log.

The file is W&B's own format: a 7-byte header (``:W&B``, a 2-byte magic, a version byte), then LevelDB's
log format (32 KiB blocks of records: crc32 (4 bytes), length (2), type (1: full, 2: first, 3: middle,
4: last), data), each record a serialized ``wandb.proto.wandb_internal_pb2.Record``. wandb 0.31 no
longer ships a Python reader, and ``wandb sync`` needs the network, so the tests read it here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2  # the test requirements install wandb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block's tail too short for a record header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:  # zero padding up to the end of the block
            pos += room - 7
            continue
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_runs(log_dir: Path) -> list[dict]:
    """Each offline run directory under ``log_dir/wandb``, oldest first: its run record and history rows."""
    runs = []
    for directory in sorted((log_dir / "wandb").glob("offline-run-*")):
        (path,) = directory.glob("run-*.wandb")
        found = {"dir": directory, "history": []}
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found.update(run_id=record.run.run_id, project=record.run.project, name=record.run.display_name,
                             tags=list(record.run.tags))
            elif kind == "history":
                found["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                         for item in record.history.item})
        runs.append(found)
    return runs
