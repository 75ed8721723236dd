"""Multi-table requests: one PullMany or PushMany carries every table shard of this server
that a worker's step reads or writes.

Each part keeps its table's own semantics (sync waits and step closing, async on arrival,
chunks, duplicate detection), and a request is all or nothing: every part is checked first,
stateless checks without locks, then the step-state checks with the locks of every shard the
request names held (always taken in (table, shard) order, the order Restore uses too, so two
requests never wait on each other's locks); only then is anything read or changed. A part
refused while being applied (an update that would not be finite) takes back the parts applied
before it.

The answer-size rule of pulls lives here too, for Pull and PullMany alike: the rows alone are
checked before any wait, the exact size before the answer is allocated.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc
import numpy as np

from parallax.protocol import bulk_codec, wire
from parallax_ps import inflight, waits
from parallax_ps.errors import RequestError, invalid
from parallax_ps.optimizers import quiet_float_errors
from parallax_ps.shard import ShuttingDown, TableShard
from parallax_ps.steps import chunk_total


@dataclass(frozen=True)
class PartCounts:
    """What one request did to one table: parts, rows and row bytes (for the stats)."""

    parts: int = 0
    rows: int = 0
    nbytes: int = 0

    def __add__(self, other: "PartCounts") -> "PartCounts":
        return PartCounts(self.parts + other.parts, self.rows + other.rows,
                          self.nbytes + other.nbytes)


def _lock_order(shard: TableShard) -> tuple[str, int]:
    return shard.spec.name, shard.shard_index


class held:
    """Hold the lock of every distinct shard, taken in (table, shard) order (a context
    manager; a class, not a generator: a request takes it two or three times)."""

    __slots__ = ("conds",)

    def __init__(self, shards: Sequence[TableShard]) -> None:
        ordered = shards if len(shards) == 1 else \
            sorted({id(s): s for s in shards}.values(), key=_lock_order)
        self.conds = [shard.cond for shard in ordered]

    def __enter__(self) -> None:
        for taken, cond in enumerate(self.conds):
            try:
                waits.acquire(cond)  # (the data plane's loop takes only free locks)
            except BaseException:
                for earlier in reversed(self.conds[:taken]):
                    earlier.release()
                raise

    def __exit__(self, *exc) -> None:
        for cond in reversed(self.conds):
            cond.release()


def _counts(shards: Sequence[TableShard], rows: Sequence[int], nbytes: Sequence[int]
            ) -> dict[str, PartCounts]:
    totals: dict[str, list[int]] = {}
    for shard, n, size in zip(shards, rows, nbytes):
        total = totals.setdefault(shard.spec.name, [0, 0, 0])
        total[0] += 1
        total[1] += n
        total[2] += size
    return {name: PartCounts(*total) for name, total in totals.items()}


def _too_large(method: str, size: int, limit: int, exact: bool) -> RequestError:
    what = "" if exact else "at least "
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{method} would answer {what}{size} bytes, over the server's message "
                        f"limit of {limit} bytes; split the request (the client does, by "
                        f"ClientOptions.chunk_mb) or raise --max-message-mb")


def check_answer_size(method: str, shards: Sequence[TableShard], ids: Sequence[np.ndarray],
                      limit: int) -> None:
    """Refuse at once (before any wait) an answer whose rows alone are over the limit; the
    exact size, headers included, is checked before the answer is allocated."""
    total = sum(len(i) * s.spec.dim * s.answer_dtype().itemsize
                for s, i in zip(shards, ids))
    if total > limit:
        raise _too_large(method, total, limit, exact=False)


def hold_answer(method: str, shards: Sequence[TableShard], ids: Sequence[np.ndarray],
                deadline: float | None) -> None:
    """Hold the working memory of a pull's answer (before it is allocated; no lock held)."""
    id_bytes = sum(i.nbytes for i in ids)
    answer = sum(len(i) * s.spec.dim * s.answer_dtype().itemsize for s, i in zip(shards, ids))
    inflight.ensure(inflight.pull_need(id_bytes, answer, inflight.answer_copies()), deadline,
                    lambda: f"{method} of {sum(len(i) for i in ids)} rows ({answer} bytes)")


def _may_close(shard: TableShard, part) -> bool:
    """Whether this part may apply an update: async, or the last chunk of the last sync push
    its step waits for (the caller holds the shard's lock)."""
    steps = shard.steps
    if not steps.sync:
        return True
    mine = steps.pushes.get(part.worker)
    if (len(mine.chunks) if mine else 0) + 1 < chunk_total(part.chunk_count):
        return False
    others = sum(1 for w, p in steps.pushes.items() if w != part.worker and p.whole)
    return others + 1 >= steps.num_workers


def push_need(shards: Sequence[TableShard], parts) -> tuple[int, str]:
    """(bytes, what) a push needs: its body, and the optimizer's work on the updates it may
    apply (its rows and the sync steps it may close, whose buffered gradients are claimed
    by their shards already), less what its shards claim for the rows they buffer; the
    caller holds the shards' locks."""
    body = sum(p.ids.nbytes + p.grads.nbytes for p in parts)
    closing = {id(s): s for s, p in zip(shards, parts) if _may_close(s, p)}
    applied = sum(p.ids.nbytes + p.grads.nbytes for s, p in zip(shards, parts)
                  if id(s) in closing)
    buffered = sum(s.buffered_by(p.ids, p.grads, chunk_total(p.chunk_count))
                   for s, p in zip(shards, parts) if id(s) not in closing)
    steps = sum(s.steps.buffered_bytes for s in closing.values())
    need = inflight.push_need(body, applied + steps) - buffered  # (claimed by the tables)
    rows = sum(len(p.grads) for p in parts)
    return need, (f"a push of {rows} rows ({body} bytes)" +
                  (f", applying a sync step of {steps} buffered bytes with them," if steps
                   else ""))


@contextlib.contextmanager
def exact_answer_size(method: str) -> Iterator[None]:
    """Answer a writer's MessageTooLarge (raised before it allocates) with RESOURCE_EXHAUSTED."""
    try:
        yield
    except bulk_codec.MessageTooLarge as exc:
        raise _too_large(method, exc.size, exc.limit, exact=True) from None


def _check_capacity(shards: Sequence[TableShard], ids: Sequence[np.ndarray],
                    buffered: Sequence[int], pull: bool = False) -> None:
    """Every keyed shard with all of its parts' keys at once, and every shard with all the
    bytes its parts buffer (locks held). A pull from a dynamic table creates no rows."""
    keys: dict[int, list[np.ndarray]] = {}
    nbytes: dict[int, int] = {}
    for shard, part, size in zip(shards, ids, buffered):
        if pull and not _grows_on_pull(shard):
            continue
        if shard.spec.hashed_keys or size:
            keys.setdefault(id(shard), []).append(part)
            nbytes[id(shard)] = nbytes.get(id(shard), 0) + size
    by_id = {id(s): s for s in shards}
    needs = [(by_id[key], *need) for key, parts in keys.items()
             if (need := by_id[key].capacity_need(_keys_of(by_id[key], parts), nbytes[key]))]
    if needs:  # all together: each part fitting alone is not enough
        needs[0][0].budget.check_together(needs)


def _keys_of(shard: TableShard, parts: Sequence[np.ndarray]) -> np.ndarray:
    """The ids whose new keys `capacity_need` counts: a keyed shard's parts, together (a
    fixed table's rows all exist: it reads none)."""
    return np.concatenate(parts) if shard.spec.hashed_keys else _NO_IDS


_NO_IDS = np.zeros(0, np.int64)


def _grows_on_pull(shard: TableShard) -> bool:
    """Whether a pull may add rows to this shard (a keyed table's new keys; a dynamic
    table's pulls create none): the shards `_check_capacity(..., pull=True)` checks."""
    return shard.spec.hashed_keys and shard.vocab is None


def _ids(part, i: int) -> np.ndarray:
    """A part's ids: decoded already (packed_codec) or a wire Tensor (protobuf)."""
    ids = part.ids
    return ids if isinstance(ids, np.ndarray) else wire.decode(ids, f"part {i} ids")


def pull_many(shards: Sequence[TableShard], request, deadline: float | None,
              max_message_bytes: int, writer=bulk_codec.PullManyResponseWriter
              ) -> tuple[bytes, dict[str, PartCounts]]:
    """The answer's bytes, made by `writer` (rows gathered straight into them), and what was
    read."""
    parts = request.parts
    ids = [shard.check_ids(_ids(part, i), f"part {i} ids")
           for i, (shard, part) in enumerate(zip(shards, parts))]
    check_answer_size("PullMany", shards, ids, max_message_bytes)
    for shard, part in zip(shards, parts):  # one at a time, no lock held across waits
        if part.min_step > shard.steps.step:  # (checked again below, with the locks held)
            inflight.give_back_held()  # (the push closing the step may need the room)
            shard.wait_step(part.min_step, deadline)
    grows = any(_grows_on_pull(shard) for shard in shards)
    if grows:
        with held(shards):  # the tables' own limits first: their refusal says more
            _check_capacity(shards, ids, [0] * len(ids), pull=True)
    hold_answer("PullMany", shards, ids, deadline)
    with held(shards):
        for shard in shards:  # deleted (or the server stopping) since it was looked up
            if shard.closed:
                raise ShuttingDown(shard.closed)
        steps = [shard.steps.step for shard in shards]
        for shard, part, step in zip(shards, parts, steps):
            if step < part.min_step:  # only a restore in between can move a step back
                raise RequestError(grpc.StatusCode.ABORTED,
                                   f"{shard.label} went back to step {step} (restored) "
                                   f"while a pull waited for step {part.min_step}; retry")
        if grows:
            _check_capacity(shards, ids, [0] * len(ids), pull=True)
        with exact_answer_size("PullMany"):
            answer = writer([(len(i), s.spec.dim, s.answer_dtype(), step)
                             for s, i, step in zip(shards, ids, steps)],
                            max_bytes=max_message_bytes)
        for shard, part_ids, out in zip(shards, ids, answer.values):
            shard.gather_held(part_ids, out)
    counts = _counts(shards, [len(i) for i in ids], [v.nbytes for v in answer.values])
    return answer.data(), counts


def _check_distinct(parts: Sequence[bulk_codec.BulkPush]) -> None:
    """Each chunk once, and chunks of one shard's push agree on what push they belong to."""
    seen: set[tuple[str, int, int]] = set()
    pushes: dict[tuple[str, int], tuple[int, int, int, int]] = {}
    for i, part in enumerate(parts):
        key = (part.table, part.shard_index, part.chunk_index)
        where = f"PushMany part {i} (table {part.table!r} shard {part.shard_index})"
        if key in seen:
            raise invalid(f"{where} repeats chunk {part.chunk_index}; send each chunk once")
        seen.add(key)
        push = (part.step, part.worker, part.session, chunk_total(part.chunk_count))
        first = pushes.setdefault(key[:2], push)
        if push != first:
            raise invalid(f"{where}: step, worker, session and chunk_count {push} differ from "
                          f"{first} of an earlier chunk of the same push; one push per shard")


def _check_same_rate(shards: Sequence[TableShard], parts: Sequence[bulk_codec.BulkPush],
                     rates: Sequence[float]) -> None:
    """Chunks of one sync push agree on the learning rate (as separate Push requests must:
    the shard refuses a chunk whose rate differs from the one its push already gave)."""
    first: dict[int, tuple[int, float]] = {}
    for i, (shard, part, lr) in enumerate(zip(shards, parts, rates)):
        if not shard.steps.sync:
            continue
        j, rate = first.setdefault(id(shard), (i, lr))
        if rate != lr:
            raise invalid(f"PushMany part {i} ({shard.label}): learning_rate {lr} differs "
                          f"from the {rate} of part {j}, a chunk of the same push; workers "
                          f"and chunks of one step must agree")


def _check_push_held(shards, parts, checked, chunks) -> None:
    """A push's step-state and capacity checks (the locks of its shards held)."""
    for shard, part, (_, lr, _), count in zip(shards, parts, checked, chunks):
        shard.check_push_state(part.step, part.worker, lr, part.chunk_index, count,
                               part.session)
    _check_capacity(shards, [ids for ids, _, _ in checked],
                    [s.buffered_by(ids, grads, count) for s, (ids, _, grads), count in
                     zip(shards, checked, chunks)])


def push_many(shards: Sequence[TableShard], parts: Sequence[bulk_codec.BulkPush],
              deadline: float | None = None
              ) -> tuple[list[tuple[int, bool]], dict[str, PartCounts]]:
    """Apply every part or none: [(steps applied, completed a step)] per part, and counts."""
    _check_distinct(parts)
    checked = [shard.check_push_input(part.ids, part.grads, part.learning_rate)
               for shard, part in zip(shards, parts)]
    _check_same_rate(shards, parts, [lr for _, lr, _ in checked])
    chunks = [chunk_total(part.chunk_count) for part in parts]
    while True:  # the tables' own checks first (their refusal says more), then the working
        with held(shards):  # memory: at once if there is room (the usual case), else waited
            _check_push_held(shards, parts, checked, chunks)  # for without the locks, and
            need, what = push_need(shards, parts)  # every check and the need again (pushes
            results = _apply_now(shards, parts, checked, chunks, need, what)  # that came
        if results is not None:  # meanwhile may make it the one closing a step)
            break
        inflight.ensure(need, deadline, what)
    counts = _counts(shards, [len(p.grads) for p in parts], [p.grads.nbytes for p in parts])
    return results, counts


def _apply_now(shards, parts, checked, chunks, need: int, what
               ) -> list[tuple[int, bool]] | None:
    """`_apply_all` (locks held, checks passed) if the push's working memory is there
    without waiting; None, having changed nothing, if it is not."""
    if not inflight.try_ensure(need, what):
        return None
    with quiet_float_errors():
        return _apply_all(shards, parts, checked, chunks)


def _apply_all(shards: Sequence[TableShard], parts: Sequence[bulk_codec.BulkPush],
               checked: Sequence[tuple[np.ndarray, float, np.ndarray]], chunks: Sequence[int]
               ) -> list[tuple[int, bool]]:
    """Apply every checked part in order (locks held, float errors quiet); a part refused
    while being applied takes back the parts before it, so the request changes nothing."""
    journal: list = []
    results = []
    try:
        for i, (shard, part, (ids, lr, grads), count) in enumerate(zip(shards, parts, checked,
                                                                       chunks)):
            last = i == len(parts) - 1  # nothing after it can be refused: no journal
            results.append(shard.apply_push_held(part.step, part.worker, ids, grads, lr,
                                                 part.chunk_index, count, part.session,
                                                 None if last else journal))
    except RequestError:
        for shard, applied in reversed(journal):
            shard.undo(applied)
        raise
    return results
