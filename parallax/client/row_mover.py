"""Move a table's rows and optimizer slots into a table with another shard count or
placement, between steps.

The source is read shard by shard, page by page (ExportRows); each page is split by the
target's router and written to the owning target shards (ImportRows), all pages of one
source page in flight at once. Only touched rows travel: an untouched row of a
fixed-vocabulary table is its initial value, the same on any shard count. A dynamic
table's rows carry their use history (uses, last_used), so LRU, LFU and TTL decide after
the move as before it; a bounded target with fewer shards evicts by its policy. Every target
shard is also told the step the source had applied, so a synchronous job goes on with the
step it was at. Both sides refuse while a push is pending, so a page never mixes two steps.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from parallax.client.table import ShardedTable
from parallax.errors import ConfigError
from parallax.protocol import wire
from parallax.ps.v1 import ps_pb2

MOVE_THREADS = 8  # source shards read at once
HISTORY = ("uses", "last_used")  # a dynamic table's use history, carried with its rows


@dataclass(frozen=True)
class MoveReport:
    """What one table's move carried."""

    rows: int
    bytes: int
    step: int
    seconds: float


def check_compatible(source: ShardedTable, target: ShardedTable) -> None:
    a, b = source.spec, target.spec
    same = (a.dim, a.vocabulary_size, a.dtype, a.optimizer, a.initializer, a.hashed_keys)
    if same != (b.dim, b.vocabulary_size, b.dtype, b.optimizer, b.initializer, b.hashed_keys):
        raise ConfigError(f"cannot move rows of {a.name!r} into {b.name!r}: the tables differ "
                          f"in more than shard count and placement "
                          f"({a.describe_difference(b)})")


def import_page(target: ShardedTable, page: ps_pb2.ShardRows, step: int) -> None:
    """Split one exported page by target shard and write the parts concurrently."""
    ids = wire.decode(page.ids, "ids")
    values = wire.decode(page.values, "values")
    slots = [wire.decode(t, "slot") for t in page.slots]
    history = [wire.decode(getattr(page, f), f) for f in HISTORY if page.HasField(f)]
    order, offsets = target.router.shard_order(ids)
    if order is not None:
        ids, values = ids[order], values[order]
        slots, history = [s[order] for s in slots], [h[order] for h in history]
    calls = []
    for shard in range(target.spec.shard_count):
        lo, hi = int(offsets[shard]), int(offsets[shard + 1])
        if hi == lo:
            continue
        request = ps_pb2.ShardRows(table=target.name, shard_index=shard, step=step,
                                   slot_names=list(page.slot_names))
        wire.encode(ids[lo:hi], request.ids)
        wire.encode(values[lo:hi], request.values)
        for slot in slots:
            wire.encode(slot[lo:hi], request.slots.add())
        for field, array in zip(HISTORY, history):  # a dynamic table's: uses, last_used
            wire.encode(array[lo:hi], getattr(request, field))
        conn = target.shards[shard]
        calls.append((conn, conn.future("ImportRows", request), request))
    for conn, future, request in calls:
        conn.result(future, "ImportRows", request, target.name)


def set_step(target: ShardedTable, step: int | list[int], slot_names: list[str],
             restart_changes: bool) -> None:
    """An empty page to every target shard: shards no row landed on still get the step (one
    for all, or one per shard), and a caught-up table starts counting its changes afresh."""
    dim, dtype = target.spec.dim, np.dtype(target.spec.dtype)
    steps = step if isinstance(step, list) else [step] * len(target.shards)
    for shard, conn in enumerate(target.shards):
        request = ps_pb2.ShardRows(table=target.name, shard_index=shard, step=steps[shard],
                                   slot_names=slot_names, restart_changes=restart_changes)
        wire.encode(np.zeros(0, np.int64), request.ids)
        wire.encode(np.zeros((0, dim), dtype), request.values)
        for _ in slot_names:
            wire.encode(np.zeros((0, dim), dtype), request.slots.add())
        conn.call("ImportRows", request, target.name)


def _move_shard(source: ShardedTable, shard: int, target: ShardedTable, page_rows: int,
                changed_only: bool) -> tuple[int, int, int | None, list[str]]:
    """Copy one source shard page by page: (rows, bytes, step, slot names)."""
    rows = nbytes = 0
    step = None
    slot_names: list[str] = []
    for page in source.export_pages(shard, page_rows, changed_only):
        step, slot_names = page.step, list(page.slot_names)
        count = page.ids.shape[0] if page.ids.shape else 0
        if count:
            import_page(target, page, page.step)
        rows += count
        nbytes += len(page.values.content) + sum(len(s.content) for s in page.slots)
    return rows, nbytes, step, slot_names


def move_rows(source: ShardedTable, target: ShardedTable, page_rows: int = 0,
              changed_only: bool = False) -> MoveReport:
    """Copy every touched row and its slots from `source` into `target` (created, empty) and
    give `target` the source's step. The source is left as it was. Source shards are read
    concurrently (each page by page), so a move runs at the pace of the links, not of one
    round trip after another.

    `changed_only`: copy only the rows training wrote in `source` since it was made (or last
    caught up), into the table `source` was made from (kept, unchanged since): that catches
    it up, and it counts its own changes afresh from then."""
    check_compatible(source, target)
    start = time.perf_counter()
    count = source.spec.shard_count
    with ThreadPoolExecutor(max_workers=min(count, MOVE_THREADS)) as pool:
        moved = list(pool.map(lambda shard: _move_shard(source, shard, target, page_rows,
                                                        changed_only), range(count)))
    steps = {step for _, _, step, _ in moved}
    if len(steps) > 1:
        raise ConfigError(
            f"cannot reshard {source.name!r}: its shards are at different steps "
            f"{sorted(steps)}; a push is still landing. Wait for every worker's pushes "
            f"(RemoteTable.wait_for_pushes) first")
    step = steps.pop() or 0
    set_step(target, step, moved[0][3], restart_changes=changed_only)
    return MoveReport(rows=sum(m[0] for m in moved), bytes=sum(m[1] for m in moved),
                      step=step, seconds=time.perf_counter() - start)
