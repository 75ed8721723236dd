"""Does a plan fit the parameter servers' memory? Checked by the chief before it creates any
table, with the memory each server reports (`parallax server --memory-mb`, its cgroup limit,
or its RAM), so a job whose tables cannot fit stops at once with the numbers and the fixes
instead of when a server runs out of memory mid-training.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from parallax.placement.planner.types import PlannerError, size_text
from parallax.placement.plan import Plan, dtype_bytes
from parallax.protocol.specs import TableSpec, slot_names


def table_bytes(spec: TableSpec) -> int:
    """Values and optimizer slots of a whole table on the servers: a fixed vocabulary's, or a
    bounded keyed table's at its bound (an unbounded one's grow with its keys: 0 here)."""
    rows = spec.max_rows_per_shard * spec.shard_count if spec.hashed_keys else \
        spec.vocabulary_size
    return rows * spec.dim * dtype_bytes(spec.dtype) * (1 + len(slot_names(spec.optimizer)))


def server_bytes(plan: Plan, specs: Mapping[int, TableSpec], replicas: int = 1) -> list[int]:
    """What each server would hold under the plan's placement (`replicas=2`: a copy of each
    shard on the next server too, `parallax.client.replicas`)."""
    n = plan.num_servers
    held = [0] * n
    tables = {vp.table or f"#{vp.index}": vp for vp in plan.on_servers}  # a group once
    for vp in tables.values():
        share = table_bytes(specs[vp.index]) / max(1, vp.shards)
        for server in vp.servers or range(vp.shards):
            for copy in range(replicas):
                held[(server + copy) % n] += int(share)
    return held


def check_fits(plan: Plan, specs: Mapping[int, TableSpec], memory: Sequence[int],
               replicas: int = 1) -> None:
    """Raise PlannerError unless every server's tables (with their copies) fit its memory
    (0: not reported)."""
    held = server_bytes(plan, specs, replicas)
    over = [i for i, (h, m) in enumerate(zip(held, memory)) if m and h > m]
    if not over:
        return
    worst = max(over, key=lambda i: held[i] - memory[i])
    total, smallest = sum(held), min(m for m in memory if m)
    biggest = max(plan.on_servers, key=lambda v: table_bytes(specs[v.index]))
    big_bytes = table_bytes(specs[biggest.index])
    fixes = [f"add servers: the tables need {size_text(total)} in all, so at least "
             f"{math.ceil(total / smallest)} servers of {size_text(smallest)}",
             f"give the servers more memory (a larger container, or `parallax server "
             f"--memory-mb` if the limit reported is wrong): server {worst} needs at least "
             f"{size_text(held[worst])}"]
    if biggest.shards < plan.num_servers:
        fixes.append(f"spread the largest table, {biggest.name!r} ({size_text(big_bytes)} "
                     f"with its optimizer slots), over more servers: "
                     f"shards={{{biggest.name!r}: {plan.num_servers}}}")
    fixes.append("use an optimizer with fewer slots per row (Adam keeps 2, Adagrad 1, plain "
                 "SGD none) or a smaller embedding dimension")
    raise PlannerError(
        f"the plan does not fit the parameter servers' memory: server {worst} would hold "
        f"{size_text(held[worst])} of tables (values and optimizer slots"
        f"{', and copies of the shards next door: replicas=2' if replicas > 1 else ''}) but has "
        f"{size_text(memory[worst])}; per server: "
        f"{', '.join(f'{size_text(h)} of {size_text(m)}' for h, m in zip(held, memory))}",
        fixes, table=biggest.name, needed_bytes=held[worst],
        server_memory_bytes=memory[worst], num_servers=plan.num_servers, shards=biggest.shards)
