"""The tables' rows, optimizer slots and steps carried inside a TF checkpoint or Keras file,
for servers that cannot write checkpoints of their own (no data directory: the embedded
servers of `ParallaxStrategy()` outside `parallax run`, or `parallax run` without
`--data-dir`).

Saving reads every shard's touched rows page by page (ExportRows: values, slots, and a
dynamic table's use history) and keeps the pages' bytes, with each page's table, shard and
step, in one byte string (`export_state`); the checkpoint holds it as a uint8 tensor beside
the JSON reference (`parallax.tf.state.resume`). Restoring writes the pages into the tables the plan
created under the saved names (ImportRows, split by the target's router) and gives every
shard its saved step (`import_state`), so a new process continues exactly where the saved one
was, as with a data directory. The file grows by the tables' touched rows and slots.
"""
from __future__ import annotations

import json
import struct
from typing import Iterator, Mapping

from parallax.client import row_mover
from parallax.client.table import ShardedTable
from parallax.errors import ConfigError
from parallax.ps.v1 import ps_pb2

_LENGTH = struct.Struct("<Q")  # the JSON index's length, first


def export_state(tables: Mapping[str, ShardedTable]) -> tuple[bytes, dict[str, int]]:
    """(every shard's rows as one byte string, each table's step: its shards' highest).
    Between steps only (every worker's pushes landed)."""
    index, blobs, steps = [], [], {}
    for name, table in tables.items():
        for shard in range(table.spec.shard_count):
            for page in table.export_pages(shard):
                blob = page.SerializeToString()
                index.append([name, shard, page.step, len(blob)])
                blobs.append(blob)
                steps[name] = max(steps.get(name, 0), page.step)
    header = json.dumps({"pages": index}).encode()
    return _LENGTH.pack(len(header)) + header + b"".join(blobs), steps


def _pages(state: bytes) -> Iterator[tuple[str, int, int, ps_pb2.ShardRows]]:
    try:
        (length,) = _LENGTH.unpack_from(state)
        index = json.loads(state[_LENGTH.size:_LENGTH.size + length])["pages"]
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"the tables' rows in this checkpoint are unreadable ({exc}); it "
                          f"was cut short or written by another parallax version") from None
    at = _LENGTH.size + length
    for name, shard, step, size in index:
        yield name, shard, step, ps_pb2.ShardRows.FromString(state[at:at + size])
        at += size


def import_state(state: bytes, tables: Mapping[str, ShardedTable]) -> dict[str, int]:
    """Write the saved pages into `tables` (created, empty, under the saved names) and give
    every shard its saved step (each its own when the shard count is the saved one, else the
    table's highest); the steps by table."""
    saved: dict[str, dict[int, int]] = {}
    slot_names: dict[str, list[str]] = {}
    for name, shard, step, page in _pages(state):
        if name not in tables:
            raise ConfigError(f"this checkpoint holds rows of table {name!r}, which this job "
                              f"does not have ({sorted(tables)}); restore it into the model "
                              f"that saved it")
        if page.ids.shape and page.ids.shape[0]:
            row_mover.import_page(tables[name], page, step)
        saved.setdefault(name, {})[shard] = step
        slot_names[name] = list(page.slot_names)
    for name, steps in saved.items():
        target = tables[name]
        same = sorted(steps) == list(range(target.spec.shard_count))
        row_mover.set_step(target, [steps[i] for i in range(target.spec.shard_count)] if same
                           else max(steps.values()), slot_names[name], restart_changes=False)
    return {name: max(steps.values()) for name, steps in saved.items()}
