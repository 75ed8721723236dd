"""A push's working memory against `--memory-mb` (servers/parallax_ps/many.py `push_many`):
taken without waiting under its shards' locks when there is room, else waited for without
them, after which every check and the need itself are worked out again; on the data plane's
loop thread a push that would wait changes nothing and goes to a thread. In-process shards
and budgets, no server."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from parallax.protocol import bulk_codec
from parallax.protocol.specs import TableSpec
from parallax_ps import inflight, many, waits
from parallax_ps.budget import MemoryBudget
from parallax_ps.shard import TableShard

MIB = 1 << 20


def _shard(budget: MemoryBudget, name: str, rows: int = 1000, dim: int = 16,
           workers: int = 1) -> TableShard:
    return TableShard(TableSpec(name=name, vocabulary_size=rows, dim=dim,
                                num_workers=workers), 0, budget)


def _part(table: str, rows: int, dim: int = 16, worker: int = 0) -> bulk_codec.BulkPush:
    return bulk_codec.BulkPush(table=table, shard_index=0, step=0, worker=worker,
                               ids=np.arange(rows, dtype=np.int64),
                               grads=np.ones((rows, dim), np.float32), learning_rate=0.1,
                               chunk_index=0, chunk_count=1)


def _free(lock) -> bool:
    """Whether another thread may take `lock` now."""
    got = []

    def probe() -> None:
        if lock.acquire(timeout=0.5):
            lock.release()
            got.append(True)
    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return bool(got)


def _fill(budget: MemoryBudget, leave: int = 0) -> int:
    """Hold all of the budget's room but `leave` bytes; returns what it held."""
    room = budget.limit - budget.baseline - budget._total - leave
    assert budget.hold(room, time.monotonic(), "the test's filler")
    return room


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_a_push_waits_for_room_without_its_shards_locks_then_applies():
    budget = MemoryBudget(8 * MIB, 0)
    a, b = _shard(budget, "a"), _shard(budget, "b")
    filler = _fill(budget)

    def push():
        with inflight.scope(budget):
            return many.push_many([a, b], [_part("a", 100), _part("b", 100)],
                                  time.monotonic() + 10)[0]
    thread, out = _in_thread(push)
    time.sleep(0.3)
    assert thread.is_alive() and not out  # waiting for room ...
    assert _free(a.cond) and _free(b.cond)  # ... without holding the tables up
    budget.unhold(filler)
    thread.join(10)
    assert out == [[(1, True), (1, True)]]
    assert budget._held == 0


def test_a_push_that_waited_holds_what_closing_the_step_needs_when_it_applies():
    """Its need was worked out before the wait; the other worker's push, come meanwhile, makes
    it the one that closes the step, which needs room for both workers' gradients."""
    budget = MemoryBudget(64 * MIB, 0)
    shard = _shard(budget, "s", rows=100_000, dim=32, workers=2)
    filler = _fill(budget, leave=4 * MIB)
    seen: dict = {}
    apply_all = many._apply_all

    def spy(shards, parts, checked, chunks):
        if parts[0].worker == 0:
            seen["held"] = inflight.current().held
            seen["need"] = many.push_need(shards, parts)[0]
        return apply_all(shards, parts, checked, chunks)

    def first():
        with inflight.scope(budget):
            return many.push_many([shard], [_part("s", 50_000, 32, worker=0)],
                                  time.monotonic() + 10)[0]
    many._apply_all = spy
    try:
        thread, out = _in_thread(first)  # 6.4 MB of gradients: waits for room
        time.sleep(0.3)
        with inflight.scope(budget):  # the other worker's push only buffers: it fits
            assert many.push_many([shard], [_part("s", 20_000, 32, worker=1)])[0] == \
                [(0, False)]
        budget.unhold(filler)
        thread.join(10)
    finally:
        many._apply_all = apply_all
    assert out == [[(1, True)]]
    assert seen["held"] >= seen["need"], seen
    assert budget._held == 0


def test_on_the_loop_thread_a_push_without_room_changes_nothing():
    budget = MemoryBudget(8 * MIB, 0)
    shard = _shard(budget, "a")
    before = shard.storage.values.copy()
    filler = _fill(budget)
    scope = inflight.Scope(budget)
    with inflight.using(scope), waits.not_here(), pytest.raises(waits.WouldWait):
        many.push_many([shard], [_part("a", 100)], time.monotonic() + 5)
    assert scope.held == 0 and shard.steps.step == 0 and _free(shard.cond)
    np.testing.assert_array_equal(shard.storage.values, before)
    budget.unhold(filler)
    with inflight.using(scope):  # a thread serves it as before
        assert many.push_many([shard], [_part("a", 100)], time.monotonic() + 5)[0] == \
            [(1, True)]
    scope.close()
    assert budget._held == 0


def test_held_gives_back_the_locks_it_took_when_a_later_one_is_busy():
    budget = MemoryBudget(0)
    a, b, c = (_shard(budget, name, rows=10, dim=2) for name in "abc")
    taken, done = threading.Event(), threading.Event()

    def hold_c() -> None:
        with c.cond:
            taken.set()
            done.wait(5)
    holder = threading.Thread(target=hold_c)
    holder.start()
    taken.wait(5)
    try:  # (locks go in table order: a, b, then c, which is busy)
        with waits.not_here(), pytest.raises(waits.WouldWait):
            with many.held([c, a, b, a]):
                pass
        assert _free(a.cond) and _free(b.cond)
    finally:
        done.set()
        holder.join()
    with many.held((a, a)):
        assert not _free(a.cond)
    assert _free(a.cond)
