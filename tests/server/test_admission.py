"""A data-plane frame's admission against `--memory-mb` (servers/parallax_ps/inflight.py
`Scope.admit`): a request is let in with its whole need from its body's size, waiting for it
holding nothing, so requests never hold the room of the bodies they received while each
waits for the rest; a pull waiting for its step holds nothing (as over gRPC), so the push
that closes the step never waits for the room of the pulls waiting for it.

Before this, a data-plane push was let in with its body's room alone and waited for the
optimizer's room holding its body: four concurrent async pushers under --memory-mb 28 held
10 MiB of bodies between them, none fitting, and every push waited out its deadline (60 s).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.many import push_many
from parallax.errors import ServerError
from parallax.protocol.bulk_codec import BulkPush
from parallax.protocol.packed_codec import PackedPullMany, PullPart
from parallax.protocol.specs import Adagrad, TableSpec
from parallax_ps import inflight, many
from parallax_ps.budget import MemoryBudget
from parallax_ps.server import RunningServer, ServerConfig
from parallax_ps.shard import TableShard

MIB = 1 << 20


def test_a_push_is_let_in_with_its_whole_need():
    budget = MemoryBudget(100 * MIB)
    scope = inflight.Scope(budget)
    scope.admit("PushManyPacked", 10 * MIB, None, "a push")
    assert scope.held == inflight.push_need(10 * MIB, 10 * MIB) == 40 * MIB
    assert budget.held == 40 * MIB and scope.floor == 10 * MIB
    scope.close()
    assert budget.held == 0


def test_a_push_whose_whole_need_never_fits_is_let_in_with_its_body():
    """A sync push that only buffers its rows needs little beyond its body: it is not
    refused for the optimizer's room it would need only if it applied every row."""
    budget = MemoryBudget(100 * MIB)
    scope = inflight.Scope(budget)
    scope.admit("PushManyPacked", 30 * MIB, None, "a push")  # whole: 120 MiB
    assert scope.held == inflight.frame_need("PushManyPacked", 30 * MIB) == 60 * MIB
    scope.close()


def _sync_part(worker: int, rows: int) -> BulkPush:
    return BulkPush(table="x", shard_index=0, step=0, worker=worker,
                    ids=np.arange(rows, dtype=np.int64),
                    grads=np.full((rows, 32), 0.01, np.float32), learning_rate=0.1,
                    chunk_index=0, chunk_count=1)


def test_a_push_whose_whole_need_stops_fitting_while_it_waits_is_let_in_with_its_body():
    """Waiting for its whole need, a sync push sees another worker's push of the step buffer
    its rows (the table's claim grows) and the whole no longer fit beside the tables: it is
    let in with its body's room, buffers, and the step closes (found in review: it was
    refused RESOURCE_EXHAUSTED, which fails a job)."""
    budget = MemoryBudget(0)
    shard = TableShard(TableSpec(name="x", vocabulary_size=50_000, dim=32, num_workers=3),
                       0, budget)
    first, second, closer = _sync_part(0, 7_700), _sync_part(1, 30_000), _sync_part(2, 500)
    body = [p.ids.nbytes + p.grads.nbytes for p in (first, second, closer)]
    budget.limit = budget._total + 4 * body[1] + body[0] // 2  # room for the second's whole
    deadline = time.monotonic() + 30
    early = inflight.Scope(budget)
    early.admit("PushManyPacked", body[0], deadline, "the first push")
    waiting = inflight.Scope(budget)
    results: list = []

    def second_push() -> None:
        waiting.admit("PushManyPacked", body[1], deadline, "the second push")
        with inflight.using(waiting):
            results.append(many.push_many([shard], [second], deadline)[0])
    thread = threading.Thread(target=second_push)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and waiting.held == 0  # waiting for its whole need
    with inflight.using(early):
        assert many.push_many([shard], [first], deadline)[0] == [(0, False)]
    early.close()  # the claim grew by the first's buffered rows: the whole cannot fit now
    thread.join(10)
    assert results == [[(0, False)]]
    assert waiting.held == inflight.frame_need("PushManyPacked", body[1])
    waiting.close()
    assert shard.push(0, 2, closer.ids, closer.grads, 0.1) == (1, True)
    assert budget.held == 0


def test_a_frame_waits_for_its_whole_need_holding_nothing():
    budget = MemoryBudget(100 * MIB)
    assert budget.hold(70 * MIB, time.monotonic(), "another request")
    scope = inflight.Scope(budget)
    admitted = threading.Thread(target=scope.admit,
                                args=("PushManyPacked", 10 * MIB, time.monotonic() + 30,
                                      "a push"))
    admitted.start()
    time.sleep(0.3)
    assert admitted.is_alive() and budget.held == 70 * MIB  # waiting, holding nothing
    budget.unhold(70 * MIB)
    admitted.join(10)
    assert not admitted.is_alive() and budget.held == scope.held == 40 * MIB
    scope.close()


def test_waiting_requests_keep_one_body_counted_and_the_others_against_admissions():
    """Three pull frames wait for their answers' room: the first keeps its ids' room, the
    others hold nothing (their ids held together could leave none of them the room to go
    on: eight workers' 4 MiB pull frames waited out their deadlines) but still count
    against new frames, which wait rather than read more bodies into that memory (64
    concurrent pulls took the server to 1.45x --memory-mb otherwise; both found in
    review)."""
    budget = MemoryBudget(64 * MIB)
    deadline = time.monotonic() + 30
    pulls = [inflight.Scope(budget) for _ in range(3)]
    for scope in pulls:
        scope.admit("PullManyPacked", MIB, deadline, "a pull")  # 3 MiB each
    assert budget.hold(55 * MIB, time.monotonic(), "another request")  # 64 MiB held
    answered: list = []

    def answer(scope) -> None:
        scope.ensure(20 * MIB, deadline, "its answer")
        answered.append(scope)
        scope.close()
    threads = [threading.Thread(target=answer, args=(scope,)) for scope in pulls]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    assert not answered and budget.held == 56 * MIB and budget._uncounted == 2 * MIB
    late = inflight.Scope(budget)  # 7.5 MiB: 56 + 7.5 fits, 56 + 2 uncounted + 7.5 not
    admitted = threading.Thread(target=late.admit, args=("PullManyPacked", 5 * MIB // 2,
                                                         deadline, "a late pull"))
    admitted.start()
    time.sleep(0.3)
    assert admitted.is_alive() and late.held == 0
    budget.unhold(55 * MIB)
    for thread in threads + [admitted]:
        thread.join(10)
    assert len(answered) == 3 and late.held == 15 * MIB // 2
    late.close()
    assert budget.held == 0 and budget._uncounted == 0


def test_a_pull_waiting_for_its_step_holds_nothing():
    """Parked or waiting on a thread, a sync pull gives its admission back: the push
    closing the step may need the room."""
    budget = MemoryBudget(64 * MIB)
    shard = TableShard(TableSpec(name="sync", vocabulary_size=1000, dim=4, num_workers=2),
                       0, budget)
    ids = np.arange(1000, dtype=np.int64)
    request = PackedPullMany([PullPart("sync", 0, 1, ids)])
    scope = inflight.Scope(budget)
    scope.admit("PullManyPacked", ids.nbytes, None, "a pull")
    assert scope.held == inflight.frame_need("PullManyPacked", ids.nbytes) > ids.nbytes
    answered: list = []

    def pull() -> None:
        with inflight.using(scope):
            answered.append(many.pull_many([shard], request, time.monotonic() + 30, 64 * MIB))
    waiting = threading.Thread(target=pull)
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive() and budget.held == 0
    grads = np.zeros((len(ids), 4), np.float32)
    for worker in (0, 1):
        shard.push(0, worker, ids, grads, 0.1)
    waiting.join(10)
    assert answered and answered[0][1]["sync"].rows == len(ids)
    scope.close()
    assert budget.held == 0


@pytest.fixture
def tight_server():
    """An in-process server under --memory-mb 28 with its data plane, and three async
    Adagrad tables of 20k x 32 (15 MiB of rows and slots: 13 MiB left for requests)."""
    server = RunningServer(ServerConfig(memory_mb=28, data_port=0))
    try:
        with PSClient([server.address], ClientOptions(timeout=60)) as client:
            tables = [client.create_table(TableSpec(
                name=f"t{i}", vocabulary_size=20_000, dim=32, num_workers=4,
                sync_mode="async", optimizer=Adagrad(learning_rate=0.1))) for i in range(3)]
            yield server.service, tables
    finally:
        server.stop(0)


def test_concurrent_pushes_under_a_tight_budget_go_on_or_are_refused_at_once(tight_server):
    """Four pushers, pushes of 3 x 1k-40k rows (0.4-16 MiB): each push fits (one or two at
    a time) or can never fit; none waits out its deadline."""
    service, tables = tight_server
    errors: list[str] = []
    done = [0]

    def pusher(worker: int) -> None:
        rng = np.random.default_rng(worker)
        for step in range(25):
            n = int(rng.integers(1000, 40_000))
            try:
                push_many(tables, [rng.integers(0, 20_000, n) for _ in tables],
                          [np.ones((n, 32), np.float32)] * 3, [step] * 3, worker, [0.01] * 3)
                done[0] += 1
            except ServerError as err:
                errors.append(str(err))
    threads = [threading.Thread(target=pusher, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(45)  # (each push waiting out its 60 s deadline: past this)
    assert not any(thread.is_alive() for thread in threads), "pushes stalled"
    assert done[0] >= 20, (done, errors[:3])
    waited = [e for e in errors if "until its deadline" in e or "RESOURCE" not in e]
    assert not waited, waited[:3]
    assert all("leaving" in e and "for requests" in e for e in errors), errors[:3]  # at once
    give_back = time.monotonic() + 5  # (a request's memory goes back just after its answer)
    while service.budget.held and time.monotonic() < give_back:
        time.sleep(0.01)
    assert service.budget.held == 0


def test_two_pushes_waiting_with_their_bodies_do_not_hold_each_others_room():
    """Two frames of a push closing two tables' sync steps: each let in with its whole
    need, each needing more (the steps' buffered gradients) than the room left beside the
    other. Only one waiter keeps its body's room, so the first goes on, then the second
    (found in review: both held their bodies and waited out their deadlines)."""
    body = MIB
    budget = MemoryBudget(int(8.5 * body))
    first, second = inflight.Scope(budget), inflight.Scope(budget)
    deadline = time.monotonic() + 30
    for scope in (first, second):
        scope.admit("PushManyPacked", body, deadline, "a frame")  # 4 MiB each
    done: list = []

    def need_more(scope) -> None:
        scope.ensure(8 * body, deadline, "closing a step")
        done.append(scope)
        scope.close()  # applied and answered: its room comes back
    threads = [threading.Thread(target=need_more, args=(scope,)) for scope in (first, second)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    for thread in threads:
        thread.join(10)
    assert len(done) == 2 and budget.held == 0


def test_a_waiter_holding_none_of_its_body_leaves_the_turn_to_one_that_does():
    """A pull that waited for its step holds nothing when it waits for its answer's room:
    it takes no turn to keep a body (it keeps none), so a push waiting beside it keeps its
    own (found in review: the pull took the turn and the push's body went uncounted)."""
    budget = MemoryBudget(64 * MIB)
    deadline = time.monotonic() + 30
    pull, push = inflight.Scope(budget), inflight.Scope(budget)
    pull.admit("PullManyPacked", MIB, deadline, "a pull")
    pull.close()  # (what the pull's wait for its step left it: nothing held)
    pull.floor = MIB
    push.admit("PushManyPacked", MIB, deadline, "a push")  # 4 MiB
    assert budget.hold(budget.limit - budget.held, time.monotonic(), "another request")
    threads = [threading.Thread(target=scope.ensure, args=(20 * MIB, deadline, "more"))
               for scope in (pull, push)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    assert push.held == MIB and budget._uncounted == MIB  # the push's body kept, the pull's not
    budget.unhold(60 * MIB)
    for thread in threads:
        thread.join(10)
    pull.close()
    push.close()
    assert budget.held == 0 and budget._uncounted == 0
