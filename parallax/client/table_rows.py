"""A variable's rows on the parameter servers, seen from the worker's numpy side: what a
training step needs to know of it between TensorFlow's ops, with no TensorFlow here.

`TableRows` holds one variable's place in a server table (its rows, row width, dtype, the
table and the offset of its rows there), the worker's pushes to that table (`TablePushes`:
the step it pushes next, the pushes in flight; shared by a table group's members), its
traffic counters and its one id check. The fused step (`parallax.client.step`) and the
TensorFlow graph ops (`parallax.tf.graph.remote.RemoteTable`, a `TableRows` with graph ops) both
work on it.

Sync pushes complete in the background: a push hands the gradient (copied) to an RPC thread,
or leaves from the step's own thread with its answers read later (`Landing`), and returns.
Nothing can read a table before its pushes are in: the next pull of the table first waits
for them (`land_pushes_of`, raising their error, if any), the servers make that pull wait for
the step anyway, and exit waits for what is still in flight.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Sequence

import grpc
import numpy as np

from parallax.client.connection import run_in_background
from parallax.client.table import ShardedTable, check_id_range
from parallax.client.table_client import Pending
from parallax.client.worker_metrics import WORKER_METRICS
from parallax.errors import ConfigError, ServerError

log = logging.getLogger("parallax")


@dataclass
class TableTraffic:
    """Bytes and calls of one table on this worker, for logs and benchmarks."""

    pulls: int = 0
    pulled_rows: int = 0
    pushes: int = 0
    pushed_rows: int = 0
    pull_seconds: float = 0.0  # wall time of pulls (waits included), for the planner
    push_seconds: float = 0.0  # wall time of push RPCs, in the background or not
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class TablePushes:
    """This worker's pushes to one server table: the step it pushes next, the pushes in
    flight, whether a pull came since the last push. The variables of a table group share
    one (their table gets one push per step, carrying all of them)."""

    def __init__(self) -> None:
        self.steps = 0
        self.in_flight: list[Future] = []
        self.lock = threading.Lock()
        self.pulled_since_push = True


class TableRows:
    """The servers' copy of one variable, seen as a [rows, dim] table: rows `offset` to
    `offset + rows` of the server table `table` (offset 0 unless the variable is in a table
    group, whose members share `pushes`). `keyed`: a keyed table (`hashed_keys`; under the
    strategy always a DynamicEmbedding's dynamic table), whose ids are any int64 keys, held
    or not (the servers admit and evict rows); `value_shape` is
    then only the layer's local stand-in, and the table has no whole value to read or
    assign."""

    def __init__(self, label: str, value_shape: Sequence[int], np_dtype,
                 table: ShardedTable, *, sync: bool, worker: int = 0,
                 sends_pushes: bool = True, offset: int = 0,
                 pushes: TablePushes | None = None, keyed: bool = False) -> None:
        self.label = label  # the user's name for the variable, used in every message
        self.value_shape = tuple(int(n) for n in value_shape)
        self.np_dtype = np.dtype(np_dtype)
        self.rows = self.value_shape[0] if self.value_shape else 1
        self.row_shape = list(self.value_shape[1:])
        self.dim = int(math.prod(self.row_shape)) if self.row_shape else 1
        self.table = table
        self.offset = offset
        self.keyed = keyed
        self.table_rows = None if keyed else offset + self.rows if pushes is None else \
            table.router.vocabulary_size  # the server table's (a group's: all members')
        self.sync = sync
        self.worker = worker  # this worker's index among those that push
        self.sends_pushes = sends_pushes  # False on non-root workers under local aggregation
        self.pushes = pushes or TablePushes()
        self.traffic = TableTraffic()
        self.id_sample: list[np.ndarray] | None = None  # pulled ids, while the tuner samples
        self.on_assign = None  # called with [table] after `assign_all` (a row cache forgets)
        _TABLES.add(self)

    def check_ids(self, ids: np.ndarray) -> None:
        """Raise, naming the variable and the first bad id, if an id is out of its rows
        (every id check of the worker's step ends here)."""
        if not self.keyed:  # a keyed table takes any int64 key
            check_id_range(f"table {self.label!r}", ids, self.rows)

    def empty_rows(self) -> np.ndarray:
        """No rows, in the table's shape and dtype."""
        return np.zeros((0, self.dim), dtype=self.np_dtype)

    @property
    def steps_pushed(self) -> int:
        """The step this worker pushes next to the table (a table group's, shared)."""
        return self.pushes.steps

    @steps_pushed.setter
    def steps_pushed(self, step: int) -> None:
        self.pushes.steps = step

    def table_ids(self, ids: np.ndarray) -> np.ndarray:
        """The server table's ids of this variable's (checked) ids."""
        return ids + self.offset if self.offset else ids

    def min_step(self) -> int:
        """The step a pull must wait for (once this worker's pushes have landed)."""
        return self.steps_pushed if self.sync else 0

    def wait_for_pushes(self, timeout: float | None = None) -> None:
        """Block until this worker's pushes to the table have landed (all of them, even
        after a failure); raise the first error."""
        land_pushes_of([self], timeout)

    def take_in_flight(self) -> list[Future]:
        """This table's pushes in flight, forgotten here: the caller waits for them."""
        pushes = self.pushes
        with pushes.lock:
            in_flight, pushes.in_flight = pushes.in_flight, []
        return in_flight

    def land_pushes(self) -> None:
        """Between steps: this worker's pushes have landed and, in sync mode, the servers
        applied every step it pushed (before a checkpoint, a reshard or an assign)."""
        self.wait_for_pushes()
        if self.sync:
            self.table.wait_step(self.steps_pushed)

    # ---- one table's own pull and push (the per-table path) ----

    def pull_rows(self, unique: np.ndarray, full_precision: bool = False) -> np.ndarray:
        start = time.perf_counter()
        self.before_pull(unique)
        rows = self.table.pull_unique(self.table_ids(unique), min_step=self.min_step(),
                                      full_precision=full_precision)
        self.after_pull(unique, time.perf_counter() - start)
        return rows.astype(self.np_dtype, copy=False)

    def before_pull(self, unique: np.ndarray) -> int:
        """Checks before this table's rows are pulled: its pushes have landed, ids are in
        range. Returns the step the pull must wait for."""
        self.wait_for_pushes()
        self.check_ids(unique)
        return self.min_step()

    def after_pull(self, unique: np.ndarray, seconds: float) -> None:
        self.pushes.pulled_since_push = True
        if self.id_sample is not None:
            self.id_sample.append(unique.copy())
        with self.traffic.lock:
            self.traffic.pulls += 1
            self.traffic.pulled_rows += len(unique)
            self.traffic.pull_seconds += seconds

    def pull_all_rows(self) -> np.ndarray:
        self.refuse_whole("read as a whole")
        return self.pull_rows(np.arange(self.rows, dtype=np.int64), full_precision=True)

    def pull_exact(self, unique: np.ndarray) -> np.ndarray:
        """Rows in the table's dtype whatever its wire dtype (eager reads: saving, export)."""
        return self.pull_rows(unique, full_precision=True)

    def push_rows(self, ids: np.ndarray, grads: np.ndarray, learning_rate) -> np.int64:
        step = self.steps_pushed
        job = self.prepare_push(ids, grads)
        if job is not None:
            if self.sync:
                # numpy_function's inputs may share TensorFlow's buffers, reused once the op
                # returns: the background push gets its own copies.
                future = run_in_background(self._timed_push, job[0].copy(), job[1].copy(),
                                           step, float(learning_rate))
                self.track_push(future)
            else:
                self._timed_push(*job, step, float(learning_rate))
        return np.int64(step)

    def prepare_push(self, ids: np.ndarray, grads: np.ndarray, checked: bool = False
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """This worker's push of the open step to the server table, checked and counted:
        (table ids, grads) to send, or None when this worker does not push (local
        aggregation). `ids`: this variable's, or, when the caller `checked` them, the
        server table's ids already (a fused push, which counts the rows itself)."""
        step = self.steps_pushed
        if not self.sends_pushes:
            self.steps_pushed = step + 1
            return None
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if not checked:
            self.check_ids(ids)
            self.count_push(len(ids))
            ids = self.table_ids(ids)
        grads = grads.reshape(len(ids), self.dim)
        if self.sync:
            if not self.pushes.pulled_since_push:
                # No pull since this table's last push (a table pushed but not read this
                # step): that pull would have waited for the push and for the step to
                # close; a push for the next step before that is refused as "ahead".
                self.wait_for_pushes()
                self.table.wait_step(step)
            self.pushes.pulled_since_push = False
            _drain_at_exit()
        self.steps_pushed = step + 1
        return ids, grads

    def count_push(self, rows: int) -> None:
        with self.traffic.lock:
            self.traffic.pushes += 1
            self.traffic.pushed_rows += rows

    def track_push(self, future) -> None:
        """A push of this table in flight (a Future or a `Landing`): the next pull, assign
        and exit wait for it."""
        with self.pushes.lock:
            self.pushes.in_flight.append(future)

    def _timed_push(self, ids: np.ndarray, grads: np.ndarray, step: int,
                    learning_rate: float) -> bool:
        start = time.perf_counter()
        try:
            return self.table.push(ids, grads, step=step, worker=self.worker,
                                   learning_rate=learning_rate)
        finally:
            self.add_push_seconds(time.perf_counter() - start)

    def add_push_seconds(self, seconds: float) -> None:
        with self.traffic.lock:
            self.traffic.push_seconds += seconds

    def assign_all(self, value) -> None:
        """Replace every row (eager), e.g. when weights are loaded into a trained model."""
        self.refuse_whole("assigned a whole value")
        values = np.asarray(value, dtype=self.np_dtype)
        if values.shape != self.value_shape:
            raise ConfigError(f"cannot assign a value of shape {values.shape} to "
                              f"{self.label!r} of shape {self.value_shape}")
        self.land_pushes()
        try:
            self.table.assign(self.table_ids(np.arange(self.rows, dtype=np.int64)),
                              values.reshape(self.rows, self.dim))
        finally:
            if self.on_assign is not None:
                self.on_assign([self.table])

    def refuse_whole(self, what: str) -> None:
        """Raise if the table has no whole value (a keyed table) to be `what`."""
        if self.keyed:
            raise ConfigError(
                f"{self.label!r} is a DynamicEmbedding table: its rows live on the servers "
                f"keyed by any int64, so it cannot be {what}; read rows by key (call the "
                f"layer), export them with layer.export_rows() or layer.serving_layer(), and "
                f"save them with a tf.train.Checkpoint / Keras checkpoint in the strategy")


# ---- pushes in flight ----------------------------------------------------------------------
class Landing:
    """A fused push in flight whose requests left from the step's own thread: its answers
    are read, once, by the first thread that waits for it (`result`), so it needs no thread
    of its own. It stands where a `concurrent.futures.Future` stands for other pushes."""

    def __init__(self, pending: Pending, remotes: Sequence[TableRows], sizes,
                 send_seconds: float) -> None:
        self._pending, self._remotes, self._sizes = pending, remotes, sizes
        self._send_seconds = send_seconds  # the push's time on the worker: sending it, plus
        self._lock = threading.Lock()      # reading its answers (not the step in between)
        self._done, self._value, self._error = False, None, None

    def result(self, timeout: float | None = None) -> list[bool]:
        with self._lock:
            if not self._done:
                start = time.perf_counter()
                try:
                    self._value = self._pending.result()
                except BaseException as err:  # noqa: BLE001 - raised to every waiter
                    self._error = err
                self._done = True
                account_push(self._remotes, self._sizes,
                             self._send_seconds + time.perf_counter() - start)
        if self._error is not None:
            raise self._error
        return self._value


def land_pushes_of(tables: Sequence[TableRows], timeout: float | None = None) -> None:
    """Block until these tables' pushes in flight have landed (a fused push is in flight for
    every table it carries: it is waited for once); raise the first error, once every push
    taken here was waited for. A `Landing` is read on this thread, or, given a `timeout`,
    on an RPC thread so that the timeout bounds it too."""
    in_flight = {id(f): (f, t) for t in tables for f in t.take_in_flight()}
    if not in_flight:
        return
    waits = {key: run_in_background(f.result) if timeout is not None and
             isinstance(f, Landing) else f for key, (f, _) in in_flight.items()}
    futures = [f for f in waits.values() if not isinstance(f, Landing)]
    _, not_done = futures_wait(futures, timeout=timeout)
    if not_done:
        labels = sorted({in_flight[key][1].label for key, f in waits.items()
                         if f in not_done})
        raise ServerError(f"{len(not_done)} push(es) to {', '.join(map(repr, labels))} did "
                          f"not land within {timeout:.0f} s", address="", table=labels[0],
                          code=grpc.StatusCode.DEADLINE_EXCEEDED)
    first = None
    for future in waits.values():
        try:
            future.result()
        except Exception as err:  # noqa: BLE001 - the others are read before it is raised
            first = first or err
    if first is not None:
        raise first


def shares(sizes: Sequence[int]) -> list[float]:
    """Each size's share of their sum (equal shares of nothing)."""
    total = sum(sizes)
    return [(s / total) if total else 1.0 / max(1, len(sizes)) for s in sizes]


def account_push(remotes: Sequence[TableRows], sizes: Sequence[int], seconds: float) -> None:
    """A fused push's wall time, shared out to its tables in proportion to their rows (and
    whole to the worker's metrics)."""
    WORKER_METRICS.observe("push", seconds)
    for remote, share in zip(remotes, shares(sizes)):
        remote.add_push_seconds(seconds * share)


# ---- exit and fork -------------------------------------------------------------------------
_TABLES: weakref.WeakSet[TableRows] = weakref.WeakSet()
_EXIT_DRAIN = threading.Lock()
_EXIT_DRAIN_REGISTERED = False
EXIT_PUSH_TIMEOUT = 60.0


def _forget_in_flight() -> None:
    """In a forked child: the parent's pushes in flight are the parent's to land."""
    for table in list(_TABLES):  # a lock another thread held at the fork stays held here
        table.pushes.in_flight, table.pushes.lock = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_in_flight)


def _drain_at_exit() -> None:
    """Register `_land_pushes_in_flight` at the first background push, i.e. after embedded
    servers registered their own stop: exit handlers run last-registered first, so the last
    pushes land before those servers go away."""
    global _EXIT_DRAIN_REGISTERED
    with _EXIT_DRAIN:
        if not _EXIT_DRAIN_REGISTERED:
            atexit.register(_land_pushes_in_flight)
            _EXIT_DRAIN_REGISTERED = True


def _land_pushes_in_flight() -> None:
    """A program that ends right after its last step still delivers that step's pushes."""
    for table in list(_TABLES):
        try:
            table.wait_for_pushes(timeout=EXIT_PUSH_TIMEOUT)
        except Exception as err:  # noqa: BLE001 - exiting: report, do not mask the exit
            log.error("the last push to %r did not land, so the servers miss this worker's "
                      "last step: %s", table.label, err)
