"""One shard of one table: validates requests, then reads or updates rows under its own lock.

Every check runs before any state changes, so a rejected request leaves the shard exactly as
it was. The lock is per shard (tables never contend with each other) and numpy releases the
GIL for the heavy array work. Sync-mode readers wait on the shard's condition until the step
they need is applied, so no pull ever sees a half-applied step.

A table with a `wire_dtype` (float16, bfloat16) answers pulls with its float32 rows narrowed
to it, refusing (OUT_OF_RANGE) a row that would not stay finite, and takes pushes in either
dtype, widened to float32 before the optimizer sees them.

An update is computed on copies of the rows it touches and written back only when every
value and slot it produces is finite. What a shard holds (rows, slots, buffered sync
gradients) is claimed from the server's `MemoryBudget` before it is allocated.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from parallax.protocol import wire, wire_dtypes
from parallax.protocol.routing import ShardRouter, out_of_range
from parallax.protocol.specs import ZERO_RATE, Ftrl, TableSpec
from parallax.ps.v1 import ps_pb2
from parallax_ps import native_path, waits
from parallax_ps.admission import SKETCH_BYTES, needs_sketch
from parallax_ps.budget import MemoryBudget
from parallax_ps.errors import RequestError, invalid, precondition
from parallax_ps.eviction import Change, Vocabulary
from parallax_ps.held import HeldMarks
from parallax_ps.optimizers import ServerOptimizer, Slots, quiet_float_errors
from parallax_ps.steps import StepState
from parallax_ps.storage import new_storage

log = logging.getLogger("parallax_ps")


History = tuple[np.ndarray, np.ndarray]  # a dynamic table's (uses, last_used) of some rows

# Steps a shard may be set to: beyond any training, and far enough below int64's end that
# counting on from it never overflows the step fields of the answers.
MAX_STEP = 1 << 62
_SMALL_ELEMENTS = 1 << 16  # below this, an element-wise check beats errstate's set-up


def _name(dtype: np.dtype) -> str:
    """A dtype as the wire names it (uint16: bfloat16)."""
    try:
        return wire.dtype_name(wire.dtype_code(dtype))
    except wire.WireError:
        return np.dtype(dtype).name


def _sum_is_finite(values: np.ndarray) -> bool:
    """Whether the values are all finite, or (large arrays) their sum is: a NaN/Inf
    anywhere makes it non-finite, and an overflowed sum only sends the caller to the exact
    check."""
    if values.size < _SMALL_ELEMENTS:
        return bool(np.isfinite(values).all())
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.sum(values)))


def _all_finite(values: np.ndarray) -> bool:
    """Exact: the compiled kernel, or one summing pass first and the element-wise check only
    when the sum is not finite (a NaN/Inf, or an overflowed sum)."""
    compiled = native_path.all_finite(values)
    if compiled is not None:
        return compiled
    return _sum_is_finite(values) or bool(np.isfinite(values).all())


class ShuttingDown(RequestError):
    def __init__(self, reason: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, reason)


@dataclass
class _Applied:
    """One applied push of a multi-part request, kept until the whole request is applied:
    enough to put the rows and the step bookkeeping back if a later part is refused."""

    worker: int
    step: int
    batch: tuple[np.ndarray, np.ndarray]
    chunk: int
    session: int
    originals: list[tuple[np.ndarray, np.ndarray, Slots]]
    closed: tuple | None
    held: int  # rows the shard held before: a keyed table's new keys go with the push
    changes: list[Change]  # a dynamic table's admissions and evictions, in order


class TableShard:
    restored_from = ""  # the checkpoint a --restore-newest server created it from (CreateTable)

    def __init__(self, spec: TableSpec, shard_index: int,
                 budget: MemoryBudget | None = None) -> None:
        if not 0 <= shard_index < spec.shard_count:
            raise invalid(f"table {spec.name!r}: shard_index {shard_index} is out of range "
                          f"[0, {spec.shard_count})")
        self.spec = spec
        self.shard_index = shard_index
        self.label = f"table {spec.name!r} shard {shard_index}"
        self.router = ShardRouter(spec.shard_count, spec.vocabulary_size, spec.partition)
        self.optimizer = ServerOptimizer(spec.optimizer)
        self.budget = budget or MemoryBudget(0)
        self._max_value = float(np.finfo(spec.dtype).max)  # largest finite learning rate
        self.row_bytes = spec.dim * np.dtype(spec.dtype).itemsize * \
            (1 + len(self.optimizer.slot_names))
        rows = 0 if spec.hashed_keys else self.router.shard_size(shard_index)
        fixed = SKETCH_BYTES if needs_sketch(spec) else 0  # the admission sketch's counters
        self.budget.claim(self, rows * self.row_bytes + fixed, self.label,
                          f"creating {rows} rows of dim {spec.dim} ({self.row_bytes} bytes a "
                          f"row with its optimizer slots)")
        try:
            self.storage = new_storage(spec, shard_index, self.optimizer)
        except BaseException:
            self.budget.release(self)
            raise
        self._admitted = 0  # bytes the request being applied was checked to hold
        if spec.hashed_keys:  # a keyed shard's spare capacity: only where it fits
            self.storage.reserve = self._reserve
            self.storage.fixed_bytes = fixed
        self.vocab = Vocabulary(spec, self.label) if spec.dynamic else None
        self.steps = StepState(spec.num_workers, spec.sync_mode == "sync",
                               spec.aggregation == "mean")
        self.held = HeldMarks(self.storage.num_rows)  # held checkpoints (`held.py`)
        self.cond = threading.Condition()
        self.closed = ""  # why the shard stopped serving, once it has
        self.wire = wire_dtypes.get(spec.wire_dtype) if spec.wire_dtype else None
        self._watchers: list[Callable[["TableShard"], None]] = []

    def watch(self, callback: Callable[["TableShard"], None]) -> bool:
        """Call `callback(self)` (with `cond` held: it must not block) whenever what a waiting
        pull waits for changes: a step applied, a restore, the shard closing. True when newly
        added (a change just before it may not have been seen). Takes no lock (the data
        plane's loop must not wait for one); one thread at a time may call it."""
        if callback in self._watchers:
            return False
        self._watchers.append(callback)  # (a change being announced sees it or not)
        return True

    def _changed(self) -> None:
        """Wake whoever waits on this shard (the caller holds `cond`)."""
        self.cond.notify_all()
        for callback in self._watchers:
            callback(self)

    def answer_dtype(self, full_precision: bool = False) -> np.dtype:
        """The dtype of this table's rows in a pull answer (full precision: its own)."""
        if self.wire is None or full_precision:
            return np.dtype(self.spec.dtype)
        return self.wire.storage

    # ---- validation (no state changes) -------------------------------------------------
    def check_ids(self, ids: np.ndarray, field: str = "ids") -> np.ndarray:
        if ids.ndim != 1:
            raise invalid(f"{self.label}: {field} must be 1-D, got shape {list(ids.shape)}")
        if ids.dtype.kind != "i":
            raise invalid(f"{self.label}: {field} must be int32 or int64, got {ids.dtype.name}")
        ids = ids.astype(np.int64, copy=False)
        if len(ids) == 0:
            return ids
        if not self.spec.hashed_keys:
            if native_path.owns_all(ids, self.router, self.shard_index):
                return ids  # else the checks below say which id is wrong
            vocab = self.spec.vocabulary_size
            bad = out_of_range(ids, vocab)
            if bad is not None:
                raise invalid(f"{self.label}: id {ids[bad[0]]} (position {bad[0]}) is outside "
                              f"the vocabulary [0, {vocab}); {len(bad)} ids are out of range")
            if self.spec.shard_count == 1:
                return ids  # every id in the vocabulary is this shard's
        owner = self.router.shard_of(ids)
        wrong = np.flatnonzero(owner != self.shard_index)
        if len(wrong):
            raise invalid(f"{self.label}: id {ids[wrong[0]]} belongs to shard "
                          f"{owner[wrong[0]]} of {self.spec.shard_count}, not this one; "
                          f"route ids with parallax.protocol.routing.ShardRouter")
        return ids

    def check_rows(self, values: np.ndarray, n: int, field: str) -> None:
        dim, dtype = self.spec.dim, np.dtype(self.spec.dtype)
        if values.ndim != 2 or values.shape[1] != dim:
            raise invalid(f"{self.label}: {field} must have shape [n, {dim}], got "
                          f"{list(values.shape)}")
        if values.shape[0] != n:
            raise invalid(f"{self.label}: {field} has {values.shape[0]} rows but ids has {n}; "
                          f"send one row per id")
        if values.dtype != dtype:
            raise invalid(f"{self.label}: {field} dtype {_name(values.dtype)} does not match "
                          f"the table dtype {dtype.name}")
        if not self.spec.allow_non_finite and n and not _all_finite(values):
            bad = np.argwhere(~np.isfinite(values))[0]
            raise invalid(f"{self.label}: {field} row {bad[0]} column {bad[1]} is "
                          f"{values[bad[0], bad[1]]}; NaN/Inf are rejected (create the table "
                          f"with allow_non_finite=True to accept them)")

    def check_capacity(self, ids: np.ndarray, buffered: int = 0, exact: bool = False) -> None:
        """Refuse keys that would overflow a bounded keyed table, or new rows and `buffered`
        bytes of sync gradients that would overflow the server's memory budget (caller holds
        `cond`; changes nothing)."""
        need = self.capacity_need(ids, buffered, exact)
        if need is not None:
            self.budget.check(self, *need)

    def capacity_need(self, ids: np.ndarray, buffered: int = 0, exact: bool = False):
        """(bytes, label, what) this shard would hold with `ids`' new keys and `buffered`
        more bytes of sync gradients, for the memory budget; None when it would not grow.
        Refuses keys over a bounded keyed table's max_rows_per_shard (caller holds `cond`).
        A dynamic table's pulls create no rows and its updates keep the bound, so there it
        counts at most the bound, unless `exact` (assign, import: every key gets a row)."""
        new = 0
        if self.spec.hashed_keys and len(ids):
            new = self.storage.count_new(np.concatenate([ids, *self.steps.pending_keys()]))
        limit = self.spec.max_rows_per_shard
        if self.vocab is not None and not exact and limit:
            new = min(new, max(limit - self.storage.num_rows, 0))
        if limit and self.storage.num_rows + new > limit:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.label}: {new} new keys would exceed max_rows_per_shard="
                               f"{limit} (holding {self.storage.num_rows}); raise it or add shards")
        if not (new or buffered):
            return None
        rows, pending = self.storage.num_rows + new, self.steps.buffered_bytes + buffered
        self._admitted = self.storage.bytes_held(rows, self.row_bytes) + pending
        return (self._admitted, self.label,
                lambda: f"holding {rows} rows ({self.row_bytes} bytes a row with its slots, "
                        f"plus keys, index and spare capacity) and buffering {pending} bytes "
                        f"of step {self.steps.step}'s gradients")

    def _reserve(self, spare: int) -> bool:
        """Claim `spare` bytes of capacity beyond what the request being applied was
        admitted with (caller holds `cond`), if the budget grants them."""
        held = self.storage.bytes_held(self.storage.num_rows, self.row_bytes) + \
            self.steps.buffered_bytes
        return self.budget.reserve_spare(self, max(self._admitted, held), spare)

    def restore_need(self, restored: int):
        """(bytes, label, what) a restore of `restored` rows makes this shard hold: a keyed
        shard's rows (a fixed one claimed its whole vocabulary when it was made)."""
        rows = restored if self.spec.hashed_keys else self.storage.num_rows
        return (self.storage.bytes_held(rows, self.row_bytes, fresh=True), self.label,
                f"restoring {rows} rows ({self.row_bytes} bytes a row with its slots)")

    def _account(self) -> None:
        """Tell the budget what this shard holds now (after a checked change); a closed
        (deleted) shard has released its claim."""
        if self.closed:
            return
        held = self.storage.bytes_held(self.storage.num_rows, self.row_bytes) + \
            self.steps.buffered_bytes
        if self.held.nbytes and not self.budget.may_hold(self, held + self.held.nbytes):
            log.warning("%s: the copies of held checkpoints %s would take this server past "
                        "--memory-mb; dropped them (a resume from them restores from disk "
                        "instead)", self.label, self.held.names())
            self.held.clear()
        self.budget.update(self, held + self.held.nbytes)

    # ---- reads and writes ----------------------------------------------------------------
    def wait_for_step(self, min_step: int, deadline: float | None) -> int:
        """Block until `min_step` steps are applied; the caller holds `self.cond`."""
        while self.steps.step < min_step:
            if self.closed:
                raise ShuttingDown(self.closed)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                waiting = (self.steps.waiting_for() if self.steps.sync
                           else "async steps count complete pushes")
                raise RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.label}: still at step {self.steps.step}, waiting for {min_step}; "
                    f"{waiting}")
            waits.check(self, deadline)  # (the data plane's loop parks the request instead)
            self.cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)
        return self.steps.step

    def pull(self, ids: np.ndarray, min_step: int, deadline: float | None,
             allocate: Callable[[int, int], np.ndarray] | None = None) -> tuple[np.ndarray, int]:
        """(rows, step) of ids validated by `check_ids`. `allocate(n, step)` may provide the
        array to gather into (e.g. the response message's own storage), so the rows are copied
        once; it may refuse (raise), and nothing has changed then."""
        with self.cond:
            step = self.wait_for_step(min_step, deadline)
            if self.spec.hashed_keys and self.vocab is None:
                self.check_capacity(ids)
            out = allocate(len(ids), step) if allocate else None  # may refuse: nothing changed
            if self.vocab is not None:
                return self._gather_dynamic(ids, out), step
            rows = self.storage.locate(ids, create=True)
            if self.spec.hashed_keys:
                self._account()
            return self._gather(rows, out), step

    def gather_held(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows of validated `ids` into `out` (of `answer_dtype()`, or the table's dtype); the
        caller holds `cond` (and checked the capacity of a keyed table for every part of
        its request)."""
        if self.vocab is not None:
            self._gather_dynamic(ids, out)
            return
        rows = self.storage.locate(ids, create=True)
        if self.spec.hashed_keys:
            self._account()
        self._gather(rows, out)

    def _gather_dynamic(self, ids: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """A dynamic table's rows: held keys' values, and for the others the default row,
        their initializer value (what a row admitted for them starts with); no row is
        created, so pulls never change what a step's other pulls see."""
        rows, found = self.storage.find(ids)
        if found.all():
            return self._gather(rows, out)
        wide = np.empty((len(ids), self.spec.dim), dtype=self.spec.dtype)
        wide[found] = self.storage.values[rows[found]]
        wide[~found] = native_path.initial_rows(self.spec.initializer, ids[~found],
                                                self.spec.dim, self.spec.dtype)
        self.vocab.count_defaults(int((~found).sum()))
        return self._narrowed(wide, out)

    def _narrowed(self, wide: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        if out is None:
            return wide
        if out.dtype == wide.dtype:
            out[...] = wide
            return out
        return self._encoded(wide, out)

    def _encoded(self, wide: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        try:
            return wire_dtypes.encode_checked(wide, self.wire, self.spec.name, "row", out)
        except wire_dtypes.WireOverflowError as exc:
            raise RequestError(grpc.StatusCode.OUT_OF_RANGE, f"{self.label}: {exc} (pulls "
                               f"answer in the wire dtype; the server keeps float32)") from None

    def _gather(self, rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The values of storage `rows`, into `out` when given, narrowed to the wire dtype
        when `out` has it. Validated ids: mode="clip" never clips (it spares take a copy)."""
        values = self.storage.values
        if out is not None and native_path.gather(values, rows, out):
            return out  # else (a float16 overflow, no kernels) numpy's path, which refuses
        if out is None or out.dtype == values.dtype:
            return np.take(values, rows, axis=0, out=out, mode="clip")
        return self._encoded(np.take(values, rows, axis=0, mode="clip"), out)

    def check_push_input(self, ids: np.ndarray, grads: np.ndarray, learning_rate: float
                         ) -> tuple[np.ndarray, float, np.ndarray]:
        """Stateless checks of a push: (validated ids, the learning rate to apply, the
        gradients in the table's dtype)."""
        ids = self.check_ids(ids)
        grads = self._widened(grads, len(ids))
        if not 0 <= learning_rate <= self._max_value:  # NaN fails too
            raise invalid(f"{self.label}: learning_rate {learning_rate} must be finite and >= 0 "
                          f"as a {self.spec.dtype}, the table's dtype (0 uses the table's "
                          f"optimizer spec)")
        if learning_rate and isinstance(self.spec.optimizer, Ftrl) and \
                (learning_rate <= ZERO_RATE or np.dtype(self.spec.dtype).type(learning_rate) == 0):
            raise invalid(f"{self.label}: Ftrl cannot apply learning_rate {learning_rate:g}, "
                          f"a rate of 0 (as a Keras rate of 0 travels: {ZERO_RATE:g}) or 0 as "
                          f"a {self.spec.dtype}: its update divides by the rate (Keras' own "
                          f"Ftrl makes the weights NaN at 0). Start a warmup schedule above "
                          f"0, or compile with another optimizer; nothing was changed")
        return ids, learning_rate or self.spec.optimizer.learning_rate, grads

    def _widened(self, grads: np.ndarray, n: int) -> np.ndarray:
        """Checked gradients in the table's dtype: as sent, or widened from the wire dtype."""
        if self.wire is None or grads.dtype != self.wire.storage:
            if self.wire is not None and grads.dtype != np.dtype(self.spec.dtype):
                raise invalid(f"{self.label}: grads dtype {_name(grads.dtype)} is neither the "
                              f"table's wire_dtype {self.wire.name} nor its dtype "
                              f"{self.spec.dtype}; send one of those")
            self.check_rows(grads, n, "grads")
            return grads
        wide = self.wire.decode(grads)
        self.check_rows(wide, n, "grads")  # shape, and NaN/Inf as the optimizer would see
        return wide

    def check_push_state(self, step: int, worker: int, lr: float, chunk: int, chunks: int,
                         session: int) -> None:
        """Checks against the step state; the caller holds `cond`, changes nothing."""
        if self.closed:
            raise ShuttingDown(self.closed)
        self.steps.check_push(self.spec.name, self.shard_index, step, worker, chunk, chunks,
                              session)
        self.steps.check_learning_rate(self.spec.name, lr)

    def buffered_by(self, ids: np.ndarray, grads: np.ndarray, chunks: int = 1) -> int:
        """Bytes a push adds to the open step's buffer (sync steps keep pushes until all
        workers have pushed); none for a whole push of the only worker, applied at once."""
        if not self.steps.sync or (self.steps.num_workers == 1 and chunks <= 1):
            return 0
        return ids.nbytes + grads.nbytes

    def apply_push_held(self, step: int, worker: int, ids: np.ndarray, grads: np.ndarray,
                        lr: float, chunk: int, chunks: int, session: int,
                        journal: list[tuple["TableShard", _Applied]] | None = None
                        ) -> tuple[int, bool]:
        """Record (and apply, when the step completes) a checked push; the caller holds
        `cond`, under `quiet_float_errors()`. Returns (steps applied, whether this push
        completed a step). An update that would write a non-finite value or slot is refused
        and changes nothing (the keys it created are forgotten); `journal`
        (multi-part requests) collects what `undo` needs to take this push back."""
        batch, held = (ids, grads), self.storage.num_rows
        batches, completed = self.steps.add(worker, step, batch, lr, chunk, chunks, session)
        changes: list[Change] = []
        try:
            if self.vocab is not None and (batches or completed):
                updates = [self._updated_dynamic(batches, lr, changes)]
            else:
                updates = [self._updated(b_ids, b_grads, lr) for b_ids, b_grads in batches
                           if len(b_ids)]
        except RequestError:
            self.storage.forget_since(held)  # the keys it created (keyed tables)
            self.steps.withdraw(worker, step, batch, chunk, session)
            raise
        originals = [self._rows_of(rows) for rows, _, _ in updates] if journal is not None \
            else []
        for rows, values, slots in updates:
            self._write(rows, values, slots)
            self.storage.mark_changed(rows)
        closed = self.steps.complete() if completed else None
        self._account()
        if journal is not None:
            journal.append((self, _Applied(worker, step, batch, chunk, session, originals,
                                           closed, held, changes)))
        if completed:
            self._changed()
        return self.steps.step, completed

    def undo(self, applied: _Applied) -> None:
        """Take back a push `apply_push_held` journalled (the caller holds `cond`)."""
        for rows, values, slots in reversed(applied.originals):
            self._write(rows, values, slots)
        for change in reversed(applied.changes):
            self.vocab.undo(self.storage, change)
        self.storage.forget_since(applied.held)
        if applied.closed is not None:
            self.steps.reopen(applied.closed)
        self.steps.withdraw(applied.worker, applied.step, applied.batch, applied.chunk,
                            applied.session)
        self._account()

    def _rows_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, Slots]:
        return rows, np.take(self.storage.values, rows, axis=0), \
            {n: np.take(s, rows, axis=0) for n, s in self.storage.slots.items()}

    def _write(self, rows: np.ndarray, values: np.ndarray, slots: Slots) -> None:
        self.held.before_write(rows, self._rows_of)
        self._overwrite(rows, values, slots)

    def _overwrite(self, rows: np.ndarray, values: np.ndarray, slots: Slots) -> None:
        for storage, new in [(self.storage.values, values),
                             *((slot, slots[name]) for name, slot in self.storage.slots.items())]:
            if not native_path.scatter(storage, rows, new):
                storage[rows] = new

    def _updated(self, ids: np.ndarray, grads: np.ndarray, lr: float
                 ) -> tuple[np.ndarray, np.ndarray, Slots]:
        """(rows, new values, new slots) of one batch, not written yet; refused when a value
        or slot would not be finite."""
        rows = self.storage.locate(ids, create=True)
        compiled = native_path.update(self.optimizer, self.storage.values, self.storage.slots,
                                      rows, grads, self.steps.step, lr)
        if compiled is None:
            values, slots = self.optimizer.updated(self.storage.values, self.storage.slots,
                                                   rows, grads, self.steps.step, lr)
        else:
            values, slots, finite = compiled
        if not self.spec.allow_non_finite and (compiled is None or not finite):
            self._check_finite(ids, lr, values, slots)
        return rows, values, slots

    def _updated_dynamic(self, batches: list, lr: float, changes: list[Change]
                         ) -> tuple[np.ndarray, np.ndarray, Slots]:
        """`_updated` for a dynamic table: one update of the batches' (disjoint) ids, after
        admission and eviction (`eviction.py`), which are taken back if it is refused; the
        change goes into `changes`. Runs for every applied step, even without ids (TTL)."""
        ids = np.concatenate([b[0] for b in batches]) if batches else np.empty(0, np.int64)
        grads = np.concatenate([b[1] for b in batches]) if batches else \
            np.empty((0, self.spec.dim), self.spec.dtype)
        protected = np.concatenate([np.empty(0, np.int64), *self.steps.pending_keys()])
        applies, change = self.vocab.update(self.storage, ids, protected, self.steps.step)
        try:
            update = self._updated(ids[applies], grads[applies], lr)
        except RequestError:
            self.vocab.undo(self.storage, change)
            raise
        changes.append(change)
        return update

    def _check_finite(self, ids: np.ndarray, lr: float, values: np.ndarray,
                      slots: Slots) -> None:
        for name, array in (("value", values), *((f"slot {n!r}", s) for n, s in slots.items())):
            if not _all_finite(array):
                row = int(np.argwhere(~np.isfinite(array))[0][0])
                what = "the step's summed gradient" if self.steps.sync else "the gradient"
                raise invalid(f"{self.label}: this update would make the {name} of id "
                              f"{ids[row]} {array[row][~np.isfinite(array[row])][0]} (an "
                              f"overflow of {self.spec.dtype} from {what} and learning_rate "
                              f"{lr}); nothing was changed: lower the learning rate or clip "
                              f"the gradients")

    def push(self, step: int, worker: int, ids: np.ndarray, grads: np.ndarray,
             learning_rate: float, chunk: int = 0, chunks: int = 1,
             session: int = 0) -> tuple[int, bool]:
        ids, lr, grads = self.check_push_input(ids, grads, learning_rate)
        with self.cond:
            self.check_push_state(step, worker, lr, chunk, chunks, session)
            self.check_capacity(ids, self.buffered_by(ids, grads, chunks))
            with quiet_float_errors():
                return self.apply_push_held(step, worker, ids, grads, lr, chunk, chunks,
                                            session)

    def assign(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Set rows to explicit values (validated by the caller); slots keep their state."""
        with self.cond:
            self.check_capacity(ids, exact=True)
            rows = self.storage.locate(ids, create=True)
            self.held.before_write(rows, self._rows_of)
            self.storage.values[rows] = values
            self.storage.mark_changed(rows)
            if self.vocab is not None:  # assigned rows count as used now (not as a use)
                self.storage.last_used[rows] = self.steps.step
            self._account()

    def wait_step(self, min_step: int, deadline: float | None) -> tuple[int, list[int]]:
        waits.acquire(self.cond)  # (the data plane's loop takes only a free lock)
        try:
            step = self.wait_for_step(min_step, deadline)
            return step, self.steps.pushed_workers()
        finally:
            self.cond.release()

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, Slots, int, dict[str, np.ndarray]]:
        """A consistent copy (ids, values, slots, step, dynamic state) of the applied steps
        only; the state (a dynamic table's: per-row last-used step and use count, counters,
        sketch) is empty for other tables."""
        with self.cond:
            self.storage.materialize()
            values, slots = self.storage.trimmed()
            state = {}
            if self.vocab is not None:
                last_used, uses = self.storage.meta()
                state = {"last_used": last_used.copy(), "uses": uses.copy(),
                         **self.vocab.state()}
            return (self.storage.row_ids(), values.copy(),
                    {n: s.copy() for n, s in slots.items()}, self.steps.step, state)

    def check_between_steps(self, action: str = "restore") -> None:
        """Raise unless no push is pending; callers that go on to `restore` hold `cond`."""
        with self.cond:
            if self.steps.pending:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{self.label}: workers {sorted(self.steps.pushes)} have "
                                   f"pushed part of step {self.steps.step}; {action} between "
                                   f"steps, once every worker's pushes of the step have "
                                   f"landed")

    def restore(self, ids: np.ndarray, values: np.ndarray, slots: Slots, step: int,
                state: dict[str, np.ndarray] | None = None,
                discard_pending: bool = False) -> None:
        """Adopt checkpointed rows, step and dynamic state (without one, a dynamic table's
        rows count as used at `step`, never before); push bookkeeping starts afresh (pushes
        of the open step refuse the restore, or are dropped with `discard_pending`)."""
        with self.cond:
            if not discard_pending:
                self.check_between_steps()
            self.held.clear()  # what the restore replaces was never copied
            self.storage.replace(ids, values, slots)
            if self.vocab is not None:
                state = state or {}
                self.storage.set_meta(np.asarray(ids, np.int64),
                                      state.get("last_used", step), state.get("uses", 0))
                self.vocab.load(state)
            self.steps.reset(step)
            self._account()
            self._changed()

    # ---- held checkpoints (`held.py`) ---------------------------------------------------
    def hold(self, name: str) -> int:
        """Mark the applied steps' state as held checkpoint `name`; returns its step.
        Pushes of the open step may be in: they are applied (and copied on write) when it
        completes, and dropped by a rollback. Fixed-vocabulary sync shards only."""
        if self.spec.hashed_keys or not self.steps.sync:
            kind = "keyed" if self.spec.hashed_keys else "async"
            raise precondition(f"{self.label} is {kind}: held checkpoints keep fixed-"
                               f"vocabulary sync tables only; save it to disk (a checkpoint "
                               f"without held=True)")
        with self.cond:
            self.held.mark(name, self.steps.step)
            return self.steps.step

    def held_step(self, name: str) -> int:
        """The step of held checkpoint `name`; NOT_FOUND when this shard holds none."""
        with self.cond:
            step = self.held.step_of(name)
        if step is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"{self.label} holds no checkpoint {name!r} (it holds "
                               f"{self.held.names()}; held checkpoints are gone once their "
                               f"server restarts): restore one from disk")
        return step

    def holds_mark(self, name: str) -> bool:
        with self.cond:
            return self.held.step_of(name) is not None

    def roll_back(self, name: str) -> int:
        """Go back to held checkpoint `name` (the caller checked it is held, and holds
        `cond`): its rows, slots and step; the pushes of the open step are dropped."""
        step = self.held.roll_back(name, self._written_back)
        self.steps.reset(step)
        self._account()
        self._changed()
        return step

    def _written_back(self, rows: np.ndarray, values: np.ndarray, slots: Slots) -> None:
        self._overwrite(rows, values, slots)
        self.storage.mark_changed(rows)  # (changed-only exports find them)

    def keep_held(self, newest: int, name: str = "") -> None:
        """Keep the newest `newest` held checkpoints, or drop `name` (newest=0)."""
        with self.cond:
            if newest:
                self.held.keep(newest)
            else:
                self.held.drop(name)
            self._account()

    # ---- live resharding ---------------------------------------------------------------
    def export(self, offset: int, max_rows: int, changed_only: bool = False
               ) -> tuple[np.ndarray, np.ndarray, Slots, int, int, History | None]:
        """(ids, values, slots, step, total, history) of touched rows [offset, offset +
        max_rows), in a stable order (`changed_only`: rows training wrote since the shard
        was made); history: a dynamic table's (uses, last_used) of those rows, else None.
        Only between steps, so pages of one export see one state."""
        if offset < 0 or max_rows < 1:
            raise invalid(f"{self.label}: export page offset {offset} must be >= 0 and "
                          f"max_rows {max_rows} >= 1")
        with self.cond:
            self.check_between_steps("export")
            touched = self.storage.touched(changed_only)
            rows = touched[offset:offset + max_rows]
            values, slots = self.storage.trimmed()
            history = None
            if self.vocab is not None:
                last_used, uses = self.storage.meta()
                history = uses[rows], last_used[rows]
            return (self.storage.ids_of(rows), values[rows],
                    {name: slot[rows] for name, slot in slots.items()}, self.steps.step,
                    len(touched), history)

    def check_slots(self, slots: Slots, n: int) -> None:
        expected = sorted(self.optimizer.slot_names)
        if sorted(slots) != expected:
            raise invalid(f"{self.label}: rows carry optimizer slots {sorted(slots)} but this "
                          f"table's {self.spec.optimizer.kind} optimizer keeps {expected}; "
                          f"reshard between tables with the same optimizer")
        for name, values in slots.items():
            self.check_rows(values, n, f"slot {name!r}")

    def check_history(self, history: History | None, n: int) -> History | None:
        """Use history as int64 (uses, last_used), refused unless it is one integer in
        [0, MAX_STEP] per row of each."""
        if history is None:
            return None
        out = []
        for field, array in zip(("uses", "last_used"), history):
            if array.dtype.kind != "i" or array.shape != (n,):
                raise invalid(f"{self.label}: {field} must be int64 [{n}] (one per row), got "
                              f"{_name(array.dtype)} {list(array.shape)}")
            bad = np.flatnonzero((array < 0) | (array > MAX_STEP))
            if len(bad):
                raise invalid(f"{self.label}: {field} {array[bad[0]]} (row {bad[0]}) must "
                              f"be in [0, {MAX_STEP}]")
            out.append(array.astype(np.int64, copy=False))
        return out[0], out[1]

    def import_rows(self, ids: np.ndarray, values: np.ndarray, slots: Slots,
                    step: int, restart_changes: bool = False,
                    history: History | None = None) -> tuple[int, int]:
        """Adopt rows with their slots, (dynamic tables) their use history (uses,
        last_used) and the step of the table they came from; everything is checked first,
        so a bad page changes nothing. A bounded dynamic table with eviction keeps
        max_rows_per_shard by evicting among the incoming and held rows (`eviction.py`).
        Returns (rows held, step)."""
        ids = self.check_ids(ids)
        self.check_rows(values, len(ids), "values")
        self.check_slots(slots, len(ids))
        history = self.check_history(history, len(ids))
        if len(np.unique(ids)) != len(ids):
            raise invalid(f"{self.label}: imported rows repeat an id; send each id once")
        if not 0 <= step <= MAX_STEP:
            raise invalid(f"{self.label}: imported step {step} must be in [0, {MAX_STEP}]")
        with self.cond:
            if self.closed:
                raise ShuttingDown(self.closed)
            self.check_between_steps("import")
            self.held.clear()  # what the import replaces was never copied
            if self.vocab is not None:
                self._import_dynamic(ids, values, slots, step, history)
            else:
                if self.spec.hashed_keys:
                    self.check_capacity(ids, exact=True)
                self.storage.adopt(ids, values, slots)
            self._account()
            if restart_changes:
                self.storage.restart_changes()
            if step != self.steps.step:
                self.steps.reset(step)
                self._changed()
            return self.storage.num_rows, self.steps.step

    def _import_dynamic(self, ids: np.ndarray, values: np.ndarray, slots: Slots, step: int,
                        history: History | None) -> None:
        """`import_rows` into a dynamic table (caller holds `cond`): evict to keep the bound,
        then adopt the kept rows with their history (none sent: last used at `step`, 0
        uses)."""
        uses, last_used = history if history is not None else (
            np.zeros(len(ids), np.int64), np.full(len(ids), step, np.int64))
        keep, victims = self.vocab.import_room(self.storage, ids, last_used, uses)
        self.check_capacity(ids[keep])  # the bound is kept: the memory budget for the rest
        self.storage.remove(victims)
        self.storage.adopt(ids[keep], values[keep], {n: s[keep] for n, s in slots.items()})
        self.storage.set_meta(ids[keep], last_used[keep], uses[keep])
        self.vocab.count_evicted(len(victims) + int((~keep).sum()))

    def close(self, reason: str) -> None:
        with self.cond:
            self.closed = f"{self.label}: {reason}"
            self.budget.release(self)
            self._changed()

    def dynamic_stats(self) -> ps_pb2.DynamicStats | None:
        """A dynamic table's admission and eviction counters (None for other tables)."""
        if self.vocab is None:
            return None
        with self.cond:
            return ps_pb2.DynamicStats(**self.vocab.counters.as_dict())

    @property
    def nbytes(self) -> int:
        values, slots = self.storage.trimmed()
        return int(values.nbytes + sum(s.nbytes for s in slots.values()))
