"""RemoteTable's numpy side against real servers: background sync pushes; the step trace its
lookups record in (`StepTrace`)."""
from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from parallax.protocol.specs import SGD, Initializer, TableSpec
from parallax.tf.graph.remote import RemoteTable, StepTrace


def _tables(client, name):
    spec = TableSpec(name=name, vocabulary_size=10, dim=2, shard_count=2, num_workers=2,
                     initializer=Initializer(kind="zeros"), optimizer=SGD(learning_rate=1.0))
    mine = RemoteTable("words", tf.TensorShape([10, 2]), tf.float32, client.create_table(spec),
                       sync=True, worker=0)
    return mine, client.table(spec)


def test_a_push_lands_before_the_tables_next_pull_reads(client, table_name):
    mine, other = _tables(client, table_name)
    mine.push_rows(np.array([3]), np.ones((1, 2), np.float32), 0.0)   # in the background
    other.push([3], [[1.0, 1.0]], step=0, worker=1)
    np.testing.assert_allclose(mine.pull_rows(np.array([3])), [[-2.0, -2.0]])


def test_pushes_without_a_pull_in_between_wait_for_the_step_to_close(client, table_name):
    mine, other = _tables(client, table_name)
    ids, ones = np.array([1, 2]), np.ones((2, 2), np.float32)
    mine.push_rows(ids, ones, 0.0)                                  # step 0
    second = threading.Thread(target=mine.push_rows, args=(ids, ones, 0.0))   # step 1
    second.start()
    second.join(0.5)
    assert second.is_alive(), "step 1 was pushed while step 0 was still open"
    other.push(ids, ones, step=0, worker=1)
    second.join(10)
    assert not second.is_alive()
    other.push(ids, ones, step=1, worker=1)
    mine.wait_for_pushes()  # nothing was refused
    np.testing.assert_allclose(other.pull(ids, min_step=2), -4 * ones)


def test_a_failed_background_push_is_raised_by_the_next_pull(client, table_name):
    mine, _ = _tables(client, table_name)
    mine.steps_pushed = 5  # the servers are at step 0: step 5 is refused as ahead
    mine.push_rows(np.array([1]), np.ones((1, 2), np.float32), 0.0)
    try:
        mine.pull_rows(np.array([1]))
    except Exception as err:  # noqa: BLE001 - checked below
        assert "words" in str(err) or table_name in str(err)
        assert "step" in str(err)
    else:
        raise AssertionError("the refused push went unnoticed")


def test_rpc_threads_grow_while_calls_block_and_refuse_past_their_cap():
    from parallax.client.connection import _RpcThreads
    from parallax.errors import ParallaxError
    pool, release = _RpcThreads(max_threads=2), threading.Event()
    first, second = pool.submit(release.wait, 10), pool.submit(release.wait, 10)
    try:
        pool.submit(release.wait, 10)
    except ParallaxError as err:
        assert "2 parameter-server calls are already in flight" in str(err)
    else:
        raise AssertionError("a third call was queued behind two blocked ones")
    release.set()
    assert first.result(5) and second.result(5)
    assert pool.submit(lambda: 7).result(5) == 7  # a finished thread is reused
    assert pool._threads == 2


def test_a_step_trace_is_the_one_of_its_thread_and_knows_its_lookups_gradients():
    """The strategy keeps the trace of its step; lookups, which TensorFlow calls with no
    room for it, find it as their thread's (`traced_here`) until the next step begins."""
    table = object()  # (a RemoteTable: only its identity matters here)
    trace = StepTrace().begin_here()
    assert StepTrace.traced_here() is trace
    dense_shape = tf.constant([10, 2], tf.int64)
    StepTrace.traced_here().record_lookup(dense_shape, table)
    grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3], tf.int64), dense_shape)
    assert trace.owner_of(grad) is table
    assert trace.owner_of(tf.IndexedSlices(grad.values, grad.indices,
                                           tf.constant([10, 2], tf.int64))) is None
    assert trace.owner_of(tf.ones([10, 2])) is None
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(StepTrace.traced_here()))
    thread.start()
    thread.join()
    assert elsewhere[0] is not trace and elsewhere[0].owner_of(grad) is None
    trace.fusion = "fusion"
    trace.end_lookups()
    assert trace.fusion is None and trace.owner_of(grad) is table  # owners stay
    following = StepTrace().begin_here()
    assert StepTrace.traced_here() is following and following.owner_of(grad) is None
