"""The numpy side of a fused step: one pull for every grouped lookup of the step, one push
for every table, each a single multi-table request per server (`parallax.client.many`), with
no TensorFlow: TensorFlow's step calls them from its two ops (`parallax.tf.graph.fusion`), and
tests and other front ends can call them with numpy arrays.

`FusedPull` takes every grouped lookup's unique ids: every table's ids are checked in one
pass, lookups of the same table are merged and deduplicated, then every table's rows come
back from one multi-table pull, which leaves beside the previous step's push
(`_pull_after_pushes`). `FusedPush` takes every table's ids, gradient rows and learning
rate: every push is checked and counted (`TableRows.prepare_push`), then one multi-table
push sends them all. For sync tables its requests leave from the caller's thread and their
answers are read by the next pull of any of the tables (`Landing`): on the data plane a
step hands nothing to another thread. Wall time is shared out to the tables in proportion
to their rows, for the partition search's per-table figures.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from parallax import native
from parallax.client.table_client import TableClient, table_client
from parallax.client.table_rows import (Landing, TableRows, account_push, land_pushes_of,
                                        shares)
from parallax.client.worker_metrics import WORKER_METRICS
from parallax.errors import InternalError
from parallax.protocol.routing import Runs


def _pull_after_pushes(client: TableClient, remotes: Sequence[TableRows], runs: Runs
                       ) -> list[np.ndarray]:
    """The rows, read after this worker's pushes in flight. Sync tables: the pull leaves at
    once, beside the step's push, since the servers hold it until that step is applied
    (`min_step`); a failed push is reported as soon as it fails, and the pull it leaves
    waiting is let go. Async tables: the pushes land first (a worker reads its own
    updates). `runs`: the tables' ids, checked (`checked_runs`). The tables' steps pushed
    are the client's clocks (a row cache's staleness)."""
    tables = [r.table for r in remotes]
    clocks = [r.steps_pushed for r in remotes]
    if not all(r.sync for r in remotes):
        land_pushes_of(remotes)
        return client.pull(tables, [r.min_step() for r in remotes], runs, clocks)
    pulling = client.start_pull(tables, [r.min_step() for r in remotes], runs, clocks)
    try:
        land_pushes_of(remotes)  # raises a failed push's error now
    except BaseException:
        pulling.abandon()
        raise
    return pulling.result()


def checked_runs(remotes: Sequence[TableRows], ids: Sequence[np.ndarray]) -> Runs:
    """Every table's ids in range, checked in one pass (the first table with a bad id says
    which), as the `Runs` that `pull_many` and `push_many` route them by. `remotes`: one
    variable per server table (a table group's ids are checked by `TableIds`)."""
    runs = Runs([r.table.router for r in remotes], ids)
    bad = runs.first_outside([r.table_rows for r in remotes])
    if bad is not None:
        remotes[bad].check_ids(runs.run(bad))  # raises, naming the variable and the id
        raise InternalError(f"{remotes[bad].label!r} has an id out of range that its "
                            f"own check let through")
    return runs


class TableIds:
    """Variables' ids laid out per server table: the members of a table group travel as one
    run of their table's ids (each member's ids checked against its own rows, offset to
    where its rows start, and concatenated in offset order), so a request carries one part
    per table, not one per variable. Other variables' ids are their table's as they are."""

    def __init__(self, members: Sequence[TableRows], ids: Sequence[np.ndarray]) -> None:
        tables: dict[int, list[int]] = {}
        for k, member in enumerate(members):
            tables.setdefault(id(member.pushes), []).append(k)
        self.groups = [sorted(ks, key=lambda k: members[k].offset) if len(ks) > 1 else ks
                       for ks in tables.values()]
        self.heads = [members[ks[0]] for ks in self.groups]  # one variable per table
        self.lengths = [[len(ids[k]) for k in ks] for ks in self.groups]
        self.ids = [_table_ids([members[k] for k in ks], [ids[k] for k in ks], lengths)
                    for ks, lengths in zip(self.groups, self.lengths)]

    def split(self, per_table: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
        """{member position: its part} of one array per table (rows, gradients)."""
        out = {}
        for ks, lengths, values in zip(self.groups, self.lengths, per_table):
            if len(ks) == 1:
                out[ks[0]] = values
                continue
            start = 0
            for k, length in zip(ks, lengths):  # views, as np.split's
                out[k] = values[start:start + length]
                start += length
        return out

    def join(self, per_member: Sequence[np.ndarray]) -> list[np.ndarray]:
        """One array per table of one per member (in `members` order), the inverse of
        `split`."""
        return [per_member[ks[0]] if len(ks) == 1 else
                np.concatenate([per_member[k] for k in ks]) for ks in self.groups]


def _table_ids(members: Sequence[TableRows], ids: Sequence[np.ndarray],
               lengths: Sequence[int]) -> np.ndarray:
    if len(members) == 1 and members[0].table_rows in (None, members[0].rows):
        return ids[0]  # a table of its own: `checked_runs` checks its ids
    kernels = native.kernels()
    if kernels is not None:  # the same, in one compiled pass
        joined, bad = kernels.join_ids(ids, np.array([m.rows for m in members], np.int64),
                                       np.array([m.offset for m in members], np.int64))
        if bad >= 0:
            members[bad].check_ids(ids[bad])  # raises, naming the variable and the id
        return joined
    joined = np.concatenate(ids).astype(np.int64, copy=False)
    limits = np.repeat(np.array([m.rows for m in members], np.int64), lengths)
    bad = (joined < 0) | (joined >= limits)
    if bad.any():
        k = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(bad)), side="right"))
        members[k].check_ids(ids[k])  # raises, naming the variable and the id
    return joined + np.repeat(np.array([m.offset for m in members], np.int64), lengths)


class StepRouting:
    """The routing of the ids a step's fused pull read (`Runs`), which the step's fused
    push reuses when it pushes exactly those ids to the same tables: a gradient's ids are
    the pulled unique ids unless a table was read by two lookups or the gradient was
    changed. One per traced step, shared by its pull and push ops."""

    def __init__(self) -> None:
        self.pulled: Runs | None = None
        self.began: float | None = None  # the step's start (time.time()), for its duration

    def runs_for(self, remotes: Sequence[TableRows], ids: Sequence[np.ndarray]) -> Runs:
        """`checked_runs(remotes, ids)`, or the pull's `Runs` of the very same ids."""
        pulled = self.pulled
        if pulled is not None and pulled.same_ids([r.table.router for r in remotes], ids):
            return pulled
        return checked_runs(remotes, ids)


class FusedPull:
    """Pulls the rows of several lookups (each a table and its unique ids) at once."""

    def __init__(self, remotes: Sequence[TableRows], routing: StepRouting | None = None,
                 client: TableClient | None = None) -> None:
        self.remotes = list(remotes)  # one per lookup; a table may appear more than once
        self.routing = routing  # the step's push's (None: no push follows, e.g. evaluation)
        self.client = client or table_client()
        self.runs = 0

    def __call__(self, ticket: np.float64, *uniques: np.ndarray) -> list[np.ndarray]:
        """ticket: the step's start, as time.time() (parallax.tf.graph.fusion: read only for the
        step's duration in the worker's metrics); uniques: each lookup's ids."""
        start = time.perf_counter()
        tables: dict[int, TableRows] = {}
        for remote in self.remotes:
            tables.setdefault(id(remote), remote)
        merged = {key: [] for key in tables}
        for remote, unique in zip(self.remotes, uniques):
            merged[id(remote)].append(unique.astype(np.int64, copy=False))
        order = list(tables)
        ids, inverses = [], {}
        for key in order:
            parts = merged[key]
            if len(parts) == 1:
                ids.append(parts[0])
            else:  # a table read by several lookups: its rows travel once
                unique, inverse = np.unique(np.concatenate(parts), return_inverse=True)
                ids.append(unique)
                inverses[key] = np.split(inverse.reshape(-1), np.cumsum([len(p) for p in
                                                                          parts])[:-1])
        laid_out = TableIds([tables[key] for key in order], ids)
        runs = checked_runs(laid_out.heads, laid_out.ids)
        if self.routing is not None:
            runs.expect_push = True
            self.routing.pulled = runs
            self.routing.began = float(ticket) if ticket > 0 else None  # (0: a test's)
        rows = laid_out.split(_pull_after_pushes(self.client, laid_out.heads, runs))
        seconds = time.perf_counter() - start
        WORKER_METRICS.observe("pull", seconds)
        for key, u, share in zip(order, ids, shares([len(u) for u in ids])):
            tables[key].after_pull(u, seconds * share)
        by_table = {key: rows[k] for k, key in enumerate(order)}
        taken: dict[int, int] = {}
        out = []
        for remote in self.remotes:
            key = id(remote)
            table_rows = by_table[key].astype(remote.np_dtype, copy=False)
            if key in inverses:
                part = taken.get(key, 0)
                taken[key] = part + 1
                table_rows = table_rows[inverses[key][part]]
            out.append(table_rows)
        self.runs += 1
        return out


class FusedPush:
    """Pushes every table's gradient of one step in one request per server."""

    def __init__(self, remotes: Sequence[TableRows], routing: StepRouting | None = None,
                 client: TableClient | None = None) -> None:
        self.remotes = list(remotes)
        self.routing = routing or StepRouting()
        self.client = client or table_client()
        if len({id(r) for r in self.remotes}) != len(self.remotes):
            raise InternalError("a fused push names a table twice")
        sync = {r.sync for r in self.remotes}
        if len(sync) > 1:
            raise InternalError("a fused push mixes sync and async tables")
        self.sync = sync.pop() if sync else True
        self.runs = 0

    def __call__(self, *flat) -> np.int64:
        """flat: ids, grads, learning rate of every variable, in `remotes` order."""
        ids = [np.asarray(flat[3 * i]).astype(np.int64, copy=False).reshape(-1)
               for i in range(len(self.remotes))]
        # every id checked before any table counts its push: a bad id changes nothing
        laid_out = TableIds(self.remotes, ids)
        pushing = [k for k, head in enumerate(laid_out.heads) if head.sends_pushes]
        runs = self.routing.runs_for([laid_out.heads[k] for k in pushing],
                                     [laid_out.ids[k] for k in pushing]) if pushing else None
        values = laid_out.join([np.reshape(flat[3 * i + 1], (len(ids[i]), remote.dim))
                                for i, remote in enumerate(self.remotes)])
        grads, steps, rates, sending = [], [], [], []
        for k, (head, table_ids, members) in enumerate(zip(laid_out.heads, laid_out.ids,
                                                            laid_out.groups)):
            step = head.steps_pushed
            job = head.prepare_push(table_ids, values[k], checked=True)
            if job is None:
                continue
            for i in members:
                self.remotes[i].count_push(len(ids[i]))
            # numpy_function's inputs may share TensorFlow's buffers, reused once the op
            # returns: a push is encoded before it returns (`start_push_many`), and `runs`
            # holds its own copy of the ids.
            grads.append(job[1])
            steps.append(step)
            rates.append(_rate(flat, members, ids))
            sending.append(head)
        self.runs += 1
        if sending and self.sync:  # sent now; the answers are read by the next pull (`Landing`)
            start = time.perf_counter()
            pending = self.client.start_push([r.table for r in sending], grads, steps,
                                             sending[0].worker, rates, runs)
            landing = Landing(pending, sending, runs.lengths, time.perf_counter() - start)
            for remote in sending:
                remote.track_push(landing)
        elif sending:
            self._send(sending, runs, grads, steps, rates)
        began, self.routing.began = self.routing.began, None
        WORKER_METRICS.step(None if began is None else time.time() - began)
        return np.int64(len(sending))

    def _send(self, remotes: list[TableRows], runs: Runs, grads, steps, rates) -> list[bool]:
        start = time.perf_counter()
        try:
            return self.client.push([r.table for r in remotes], grads, steps,
                                    remotes[0].worker, rates, runs)
        finally:
            account_push(remotes, runs.lengths, time.perf_counter() - start)


def _rate(flat, members: Sequence[int], ids: Sequence[np.ndarray]) -> float:
    """The learning rate of a table's push: a member's that sent rows (a member the step did
    not update sends none, and rate 0.0: "the table's own"), else the first's."""
    sent = next((i for i in members if len(ids[i])), members[0])
    return float(flat[3 * sent + 2])
