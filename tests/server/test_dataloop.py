"""The data plane's event loop (servers/parallax_ps/dataloop.py), against a real server in this
process: one thread serves every greeted connection, whatever their number; a sync pull
waiting for its step is parked, and answered when its step is applied by a push on the data
plane or over gRPC, at its deadline (before the client's, with the reason, its wait in the
stats) or when its table is deleted; a slow sender, a client pipelining frames, a shard lock
held by another thread or a client that leaves while its pull is parked holds nothing up;
many workers at once get what they would over gRPC; a deleted table is not kept alive by
the connections that read it.
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.dataplane import DataPlaneClient
from parallax.client.many import pull_many, push_many
from parallax.errors import ServerError
from parallax.protocol import dataplane, packed_codec
from parallax.protocol.specs import SGD, TableSpec

VOCAB, DIM = 40, 4


@pytest.fixture()
def server():
    from parallax_ps.server import RunningServer, ServerConfig
    running = RunningServer(ServerConfig())
    yield running
    running.stop(0)


def _spec(name: str, workers: int) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=VOCAB, dim=DIM, shard_count=2,
                     optimizer=SGD(0.5), num_workers=workers)


def _greeted(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(dataplane.REQUEST.pack(dataplane.MAGIC, dataplane.HELLO, 0.0, 0))
    dataplane.read_header(sock, dataplane.RESPONSE)
    dataplane.recv_exact(sock, dataplane.SERVER_ID.size)
    return sock


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
        out["at"] = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_every_greeted_connection_is_served_by_one_thread(server):
    before = threading.active_count()
    socks = [_greeted(server.data_plane.port) for _ in range(40)]
    try:
        time.sleep(0.5)  # (the greeting threads end once they hand their connection over)
        assert threading.active_count() - before < 4, threading.active_count() - before
        with PSClient([server.address]) as client:
            table = client.create_table(_spec("crowd", 1))
            pull_many([table], [np.arange(VOCAB)], [0])
            assert client.servers[0].data_plane is not None
    finally:
        for sock in socks:
            sock.close()


def test_a_slow_sender_holds_up_no_other_request(server):
    sock = _greeted(server.data_plane.port)
    try:  # a push frame of 1 MB, of which only a few bytes come
        sock.sendall(dataplane.REQUEST.pack(dataplane.MAGIC, dataplane.CODES["PushManyPacked"],
                                            30.0, 1 << 20) + b"x" * 100)
        with PSClient([server.address]) as client:
            table = client.create_table(_spec("slow", 1))
            started = time.monotonic()
            for step in range(3):
                pull_many([table], [np.arange(8)], [step])
                push_many([table], [np.arange(8)], [np.ones((8, DIM), np.float32)], [step], 0,
                          [0.0])
            assert time.monotonic() - started < 10
    finally:
        sock.close()


def test_a_parked_pull_is_answered_by_a_push_over_grpc(server):
    with PSClient([server.address]) as plane_client, \
            PSClient([server.address], ClientOptions(data_plane=False)) as grpc_client:
        table = plane_client.create_table(_spec("cross", 1))
        thread, out = _in_thread(lambda: pull_many([table], [np.arange(VOCAB)], [1])[0])
        time.sleep(0.5)
        assert "at" not in out  # parked: step 1 is not applied
        other = grpc_client.create_table(_spec("cross", 1))
        ids = np.arange(VOCAB)
        before = pull_many([other], [ids], [0])[0]
        pushed = time.monotonic()
        push_many([other], [ids], [np.ones((VOCAB, DIM), np.float32)], [0], 0, [0.0])
        thread.join(20)
        assert "error" not in out, out.get("error")
        assert out["at"] - pushed < 5  # woken by the step, not by its deadline
        np.testing.assert_allclose(out["value"], before - 0.5, rtol=1e-6)
        assert plane_client.servers[0].data_plane is not None  # (it went that way)


def test_a_client_that_leaves_while_its_pull_is_parked_costs_nothing(server):
    server.data_plane._max_connections = 3
    with PSClient([server.address]) as client:
        table = client.create_table(_spec("leave", 1))
        plane = DataPlaneClient("127.0.0.1", server.data_plane.port, ClientOptions())
        try:
            body = packed_codec.encode_pull_many(["leave"] * 2, [0, 1], [1, 1],
                                                 [np.arange(3), np.arange(3)])
            for _ in range(6):  # each parks, and its connection is closed
                plane.send("PullMany", body, 30.0).close()
                _until(lambda: server.data_plane._greeted < 3)  # (the loop saw it close)
        finally:
            plane.close()
        time.sleep(0.5)
        push_many([table], [np.arange(6)], [np.ones((6, DIM), np.float32)], [0], 0, [0.0])
        time.sleep(0.5)  # the parked pulls are answered into closed connections: forgotten
        assert server.data_plane._greeted <= 1, server.data_plane._greeted
        assert server.data_plane._in_flight == 0
        assert server.service.budget._held == 0
        rows = pull_many([table], [np.arange(6)], [1])[0]
        np.testing.assert_allclose(rows, pull_many([table], [np.arange(6)], [0])[0])


def _until(condition, timeout_s: float = 10.0) -> None:
    """Wait for `condition()` (what the server's loop does next is not synchronous)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _train_workers(address: str, options: ClientOptions, workers: int, steps: int,
                   name: str) -> np.ndarray:
    """`workers` sync workers (threads, a client each) train `steps` steps; the rows after."""
    errors = []

    def work(rank: int) -> None:
        rng = np.random.default_rng(rank)
        try:
            with PSClient([address], options) as client:
                table = client.create_table(_spec(name, workers))
                for step in range(steps):
                    ids = np.unique(rng.integers(0, VOCAB, 10))
                    pull_many([table], [ids], [step])
                    push_many([table], [ids], [rng.normal(size=(len(ids), DIM))
                                               .astype(np.float32)], [step], rank, [0.0])
        except Exception as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    with PSClient([address]) as client:
        table = client.create_table(_spec(name, workers))
        return pull_many([table], [np.arange(VOCAB)], [steps])[0]


def test_many_workers_at_once_get_what_grpc_gives(server):
    plane = _train_workers(server.address, ClientOptions(), 6, 8, "many_plane")
    over_grpc = _train_workers(server.address, ClientOptions(data_plane=False), 6, 8,
                               "many_grpc")
    np.testing.assert_array_equal(plane, over_grpc)


def test_a_shard_lock_held_elsewhere_holds_up_no_other_table(server):
    """A save's snapshot, a restore or a push over gRPC holds a shard's lock: a data-plane
    request for that shard goes to a thread, and the loop serves the other tables."""
    with PSClient([server.address], ClientOptions(timeout=10.0, retries=0)) as client:
        busy, other = (client.create_table(_spec(name, 1)) for name in ("busy", "other"))
        pull_many([busy, other], [np.arange(3)] * 2, [0, 0])
        lock = server.service.shard("busy", 0).cond
        with lock:
            waiting, out = _in_thread(lambda: pull_many([busy], [np.arange(3)], [0]))
            time.sleep(0.2)  # (its request is with the lock's waiters)
            started = time.monotonic()
            pull_many([other], [np.arange(3)], [0])
            assert time.monotonic() - started < 0.5
            time.sleep(0.3)
            assert "at" not in out
        waiting.join(10)
        assert out["value"][0].shape == (3, DIM)


def test_a_client_that_pipelines_frames_takes_its_turn(server):
    with PSClient([server.address], ClientOptions(timeout=30.0, retries=0)) as client:
        table = client.create_table(_spec("pipelined", 1))
        pull_many([table], [np.arange(3)], [0])
        body = packed_codec.encode_pull_many(["pipelined"], [0], [0], [np.arange(3)])
        frame = dataplane.REQUEST.pack(dataplane.MAGIC, dataplane.CODES["PullManyPacked"], 0.0,
                                       len(body)) + body
        count, sock = 5000, _greeted(server.data_plane.port)

        def read_all() -> None:
            for _ in range(count):
                _, length = dataplane.read_header(sock, dataplane.RESPONSE)
                dataplane.recv_exact(sock, length)
        reader, out = _in_thread(read_all)
        writer, _ = _in_thread(lambda: sock.sendall(frame * count))
        try:
            time.sleep(0.2)
            started = time.monotonic()
            pull_many([table], [np.arange(3)], [0])
            took = time.monotonic() - started
            reader.join(60)
            assert "error" not in out, out.get("error")
            assert took < 0.5 * (out["at"] - started), (took, out["at"] - started)
        finally:
            sock.close()


def test_a_parked_pull_times_out_before_its_client_with_the_reason(server):
    with PSClient([server.address], ClientOptions(timeout=3.0, retries=0)) as client:
        table = client.create_table(_spec("late", 2))
        pull_many([table], [np.arange(3)], [0])
        started = time.monotonic()
        with pytest.raises(ServerError, match="DEADLINE_EXCEEDED.*still at step 0, waiting "
                                              "for 1.*worker.*have not pushed step 0"):
            pull_many([table], [np.arange(3)], [1])
        assert time.monotonic() - started < 2.9  # the server's answer, before the client's own
        pulls = [m for m in list(client.stats().values())[0].methods
                 if m.method == "PullMany"]
        assert pulls[0].errors == 1 and pulls[0].max_seconds > 2.5  # its wait counted


def test_a_table_deleted_under_a_parked_pull_fails_it_unavailable(server):
    with PSClient([server.address], ClientOptions(timeout=20.0, retries=0)) as client:
        table = client.create_table(_spec("gone", 2))
        waiting, out = _in_thread(lambda: pull_many([table], [np.arange(3)], [1]))
        time.sleep(0.5)
        client.delete_table(table)
        client.create_table(_spec("gone", 2))  # (a new table of the name is not the one)
        waiting.join(10)
        assert "UNAVAILABLE" in str(out.get("error")) and "deleted" in str(out["error"])


def test_a_deleted_table_is_not_kept_alive_by_the_connections_that_read_it(server):
    """What a request found (its shards) goes with the request: a connection idle after
    reading a table does not keep the table's rows in memory once it is deleted (the
    memory budget has given them back already)."""
    import gc
    import weakref
    with PSClient([server.address]) as client:
        table = client.create_table(_spec("dropped", 1))
        pull_many([table], [np.arange(VOCAB)], [0])
        push_many([table], [np.arange(4)], [np.ones((4, DIM), np.float32)], [0], 0, [0.0])
        shard = weakref.ref(server.service.shard("dropped", 0))
        client.delete_table(table)
        gc.collect()
        assert shard() is None, gc.get_referrers(shard())
        assert client.servers[0].data_plane is not None  # (its connections are still open)
