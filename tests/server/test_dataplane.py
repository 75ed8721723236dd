"""The data plane (parallax.protocol.dataplane): PullMany and PushMany as frames on the server's
data port, against real servers. The same requests give the same answers as over gRPC; TLS,
mutual TLS and the token guard it as they guard gRPC; a server without it, or whose data
port cannot be reached, is served over gRPC; a waiting pull holds only its own connection.
The fuzzer (tests/server/test_fuzz.py) sends it every fuzz case of both methods, and frames that
are no requests.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.connection import ServerConnection
from parallax.client.dataplane import DataPlaneClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.many import pull_many, push_many
from parallax.errors import ServerError
from parallax.protocol import dataplane, packed_codec
from parallax.protocol.bulk_codec import PushHeader
from parallax.protocol.packed_codec import PushManyParts
from parallax.protocol.security import generate_job_credentials, read_token
from parallax.protocol.specs import SGD, Adagrad, TableSpec
from parallax.ps.v1 import ps_pb2, ps_pb2_grpc

VOCAB, DIM = 50, 3


def _tables(client: PSClient, prefix: str, workers: int = 1):
    return [client.create_table(TableSpec(name=f"{prefix}{k}", vocabulary_size=VOCAB, dim=DIM,
                                          shard_count=2, optimizer=optimizer,
                                          num_workers=workers))
            for k, optimizer in enumerate((SGD(0.5), Adagrad(0.3)))]


def _train(tables, steps: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    for step in range(steps):
        ids = [np.unique(rng.integers(0, VOCAB, 12)) for _ in tables]
        pull_many(tables, ids, [step] * len(tables))
        push_many(tables, ids, [rng.normal(size=(len(i), DIM)).astype(np.float32) for i in ids],
                  [step] * len(tables), 0, [0.0] * len(tables))
    every = [np.arange(VOCAB)] * len(tables)
    return pull_many(tables, every, [steps] * len(tables))


@pytest.fixture(scope="module")
def servers():
    with LocalCluster(2) as cluster:
        yield cluster


def test_same_answers_as_grpc_and_the_traffic_goes_through_the_data_plane(servers):
    with PSClient(servers.addresses) as fast, \
            PSClient(servers.addresses, ClientOptions(data_plane=False)) as slow:
        over_plane, over_grpc = _train(_tables(fast, "dp_")), _train(_tables(slow, "grpc_"))
        for a, b in zip(over_plane, over_grpc):
            np.testing.assert_array_equal(a, b)
        assert all(s.data_plane for s in fast.servers)
        assert not any(s.data_plane for s in slow.servers)
        # the servers count a request the same on either path: 4 steps of pulls, 3 of pushes
        for reply in fast.stats().values():
            counted = {m.method: m.requests for m in reply.methods}
            assert counted["PullMany"] == 2 * 4 and counted["PushMany"] == 2 * 3, counted


def test_a_waiting_pull_holds_only_its_own_connection(servers):
    """Worker 0's pull of step 1 waits on the data plane while worker 1's push (another
    connection of the same client) closes the step."""
    with PSClient(servers.addresses) as client:
        tables = _tables(client, "wait_", workers=2)
        ids = [np.arange(5)] * 2
        grads = [np.ones((5, DIM), np.float32)] * 2
        push_many(tables, ids, grads, [0, 0], 0, [0.0, 0.0])
        pulled = {}
        waiter = threading.Thread(target=lambda: pulled.update(rows=pull_many(tables, ids,
                                                                             [1, 1])))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # step 1 needs worker 1's push
        push_many(tables, ids, grads, [0, 0], 1, [0.0, 0.0])
        waiter.join(30)
        assert not waiter.is_alive() and len(pulled["rows"]) == 2


def test_a_timed_out_pull_gets_the_servers_explanation(servers):
    with PSClient(servers.addresses, ClientOptions(timeout=1.0, retries=0)) as client:
        tables = _tables(client, "late_", workers=2)
        with pytest.raises(ServerError) as info:
            pull_many(tables, [np.arange(3)] * 2, [1, 1])
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "have not pushed" in str(info.value), str(info.value)


def test_a_server_without_a_data_plane_is_served_over_grpc():
    with LocalCluster(1, extra_args=["--data-port", "-1"]) as cluster, \
            PSClient(cluster.addresses) as client:
        rows = _train(_tables(client, "nodp_"))
        assert all(r.shape == (VOCAB, DIM) for r in rows)
        assert client.servers[0].data_plane is None


def test_a_server_that_does_not_know_the_methods_is_named_no_parallax_server(caplog):
    """Client and server ship together, so an UNIMPLEMENTED answer means the address is not
    a parallax server of this version: the DataPlane question warns so (and the client stays
    on gRPC), and a call's error says so."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # no services at all
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn = ServerConnection(f"127.0.0.1:{port}", ClientOptions(timeout=5))
    try:
        with caplog.at_level(logging.WARNING, logger="parallax"):
            assert conn.data_plane_of() is None  # asked once, gRPC from then on
        with pytest.raises(ServerError) as info:
            conn.call("Stats", ps_pb2.StatsRequest())
    finally:
        conn.close()
        server.stop(0)
    assert "not a parallax server of this version" in caplog.text, caplog.text
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "not a parallax server of this version" in str(info.value), str(info.value)


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    return generate_job_credentials(tmp_path_factory.mktemp("dp-creds"))


def test_mutual_tls_and_the_token_guard_the_data_plane(creds):
    token = read_token(creds.token_file)
    with LocalCluster(1, extra_args=creds.server_args()) as cluster:
        good = ClientOptions(tls_ca=str(creds.ca_cert), tls_cert=str(creds.client_cert),
                             tls_key=str(creds.client_key), token=token)
        with PSClient(cluster.addresses, good) as client:
            _train(_tables(client, "tls_"))
            assert client.servers[0].data_plane is not None  # not a fallback to gRPC
            host, port = client.servers[0].data_plane.rsplit(":", 1)
        for options, code in [
                (ClientOptions(tls_ca=str(creds.ca_cert), tls_cert=str(creds.client_cert),
                               tls_key=str(creds.client_key), token="wrong"),
                 grpc.StatusCode.UNAUTHENTICATED),
                (ClientOptions(tls_ca=str(creds.ca_cert), token=token),  # no client cert
                 grpc.StatusCode.UNAVAILABLE),
                (ClientOptions(token=token), grpc.StatusCode.UNAVAILABLE)]:  # plain text
            plane = DataPlaneClient(host, int(port), options)
            with pytest.raises(grpc.RpcError) as info:
                plane.check()
            assert info.value.code() == code, info.value.details()


# ---- attacks and accidents (review of c8a5ca4) -----------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    """One `python -m parallax_ps` on fixed ports, for tests that restart or replace it."""

    def __init__(self, port: int, data_port: int, *extra: str, prefix: tuple = ()) -> None:
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "parallax_ps", "--port", str(port), "--data-port",
             str(data_port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        with PSClient([self.address]) as client:
            client.wait_ready(30)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(20)
        finally:
            self.proc.stdout.close()

    def rss_mb(self) -> float:
        text = open(f"/proc/{self.proc.pid}/status").read()
        return int(text.split("VmRSS:")[1].split()[0]) / 1024


def _table(client: PSClient, fill: float):
    table = client.create_table(TableSpec(name="t", vocabulary_size=10, dim=2,
                                          optimizer=SGD(1.0)))
    push_many([table], [np.arange(10)], [np.full((10, 2), -fill, np.float32)], [0], 0, [1.0])
    return table


def test_a_client_never_reads_another_server_that_took_the_data_port():
    """Server A dies; B starts on A's old data port and A comes back on its gRPC port: the
    client's next pull must get A's rows (it asks A again), never B's."""
    port, data_port = _free_port(), _free_port()
    first = _Server(port, data_port)
    client = PSClient([first.address])
    try:
        table = _table(client, 1.0)
        np.testing.assert_array_equal(pull_many([table], [np.arange(3)], [1])[0], 1.0)
        assert client.servers[0].data_plane == f"127.0.0.1:{data_port}"
        assert first.stop() == 0
        other = _Server(_free_port(), data_port)
        again = _Server(port, 0)
        try:
            with PSClient([other.address]) as theirs:
                _table(theirs, 7.0)
            with PSClient([again.address]) as fresh:
                _table(fresh, 3.0)
            np.testing.assert_array_equal(pull_many([table], [np.arange(3)], [1])[0], 3.0)
            assert client.servers[0].data_plane not in (None, f"127.0.0.1:{data_port}")
        finally:
            assert other.stop() == 0 and again.stop() == 0
    finally:
        client.close()


def test_connections_that_never_say_hello_cost_a_bounded_number_of_threads():
    server = _Server(_free_port(), _free_port())
    idle = []
    try:
        with PSClient([server.address]) as client:
            host, port = (client.servers[0].data_plane_of().where.rsplit(":", 1))
            idle = [socket.create_connection((host, int(port))) for _ in range(80)]
            time.sleep(0.5)
            threads = len(os.listdir(f"/proc/{server.proc.pid}/task"))
            assert threads < 80, threads  # beyond 64 waiting for their hello: no thread
            rows = _train(_tables(client, "flood_"), steps=1)  # still served
            assert rows[0].shape == (VOCAB, DIM)
            for sock in idle[:5]:
                sock.settimeout(15)
                assert sock.recv(1) == b""  # closed by the server within the hello timeout
    finally:
        for sock in idle:
            sock.close()
        assert server.stop() == 0


def test_a_declared_length_costs_no_memory_until_the_bytes_arrive():
    server = _Server(_free_port(), _free_port())
    try:
        with PSClient([server.address]) as client:
            host, port = client.servers[0].data_plane_of().where.rsplit(":", 1)
        before = server.rss_mb()
        socks = []
        for _ in range(4):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(dataplane.REQUEST.pack(dataplane.MAGIC, dataplane.HELLO, 0.0, 0))
            dataplane.read_header(sock, dataplane.RESPONSE)
            dataplane.recv_exact(sock, 8)
            push = dataplane.CODES["PushManyPacked"]
            sock.sendall(dataplane.REQUEST.pack(dataplane.MAGIC, push, 0.0, 250 << 20))
            socks.append(sock)
        time.sleep(1.0)
        assert server.rss_mb() - before < 64, (before, server.rss_mb())
        for sock in socks:
            sock.close()
    finally:
        assert server.stop() == 0


def test_a_request_over_the_servers_limit_is_resource_exhausted_as_over_grpc():
    server = _Server(_free_port(), _free_port(), "--max-message-mb", "1")
    try:
        with PSClient([server.address]) as client:
            plane = client.servers[0].data_plane_of()
            with pytest.raises(grpc.RpcError) as info:
                plane.call("PushMany", bytes(16 << 20), 10.0)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        assert "--max-message-mb" in info.value.details()
    finally:
        assert server.stop() == 0


def test_the_data_plane_keeps_accepting_after_running_out_of_file_descriptors():
    server = _Server(_free_port(), _free_port(), prefix=("prlimit", "--nofile=96:96"))
    try:
        with PSClient([server.address]) as client:
            plane = client.servers[0].data_plane_of()
            host, port = plane.where.rsplit(":", 1)
            crowd = []
            for _ in range(150):  # past the server's descriptors: accept fails for a while
                try:
                    crowd.append(socket.create_connection((host, int(port)), timeout=2))
                except OSError:
                    break
            for sock in crowd:
                sock.close()
            time.sleep(1.0)
            fresh = DataPlaneClient(host, int(port), ClientOptions(), plane.server_id)
            fresh.check()  # accepted and greeted again
            fresh.close()
    finally:
        assert server.stop() == 0


# ---- second review (of 0822dce) -------------------------------------------------------------
@pytest.fixture
def in_process():
    """A server in this process, so a test can reach into its data plane's settings."""
    from parallax_ps.server import RunningServer, ServerConfig
    server = RunningServer(ServerConfig())
    yield server
    server.stop(0)


def _hello(where: str) -> socket.socket:
    host, port = where.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(dataplane.REQUEST.pack(dataplane.MAGIC, dataplane.HELLO, 0.0, 0))
    return sock


def test_clients_that_vanish_after_their_hello_leave_no_count_behind(in_process):
    in_process.data_plane._max_connections = 4
    where = f"127.0.0.1:{in_process.data_plane.port}"
    for _ in range(20):
        sock = _hello(where)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, perhaps before the OK is sent
    time.sleep(1.0)
    with PSClient([in_process.address]) as client:
        _train(_tables(client, "vanish_"), steps=1)
        assert client.servers[0].data_plane is not None  # not refused as full


def test_stopping_gives_data_plane_requests_their_grace(in_process):
    service = in_process.service
    slow_push, done = service.PushMany, {}

    def push_many(request, context):
        time.sleep(1.5)
        return slow_push(request, context)
    service.PushMany = push_many
    with PSClient([in_process.address], ClientOptions(retries=0)) as client:
        tables = _tables(client, "grace_")
        pushing = threading.Thread(target=lambda: done.update(
            result=push_many_or_error(tables)))
        pushing.start()
        time.sleep(0.5)
        in_process.stop(5.0)
        pushing.join(10)
    # answered by the server (the push, or its shard's "server is stopping", as over gRPC),
    # not cut off with the connection
    result = done["result"]
    assert result is True or "the server is shutting down; retry" in result, result


def push_many_or_error(tables):
    try:
        push_many(tables, [np.arange(3)] * 2, [np.ones((3, DIM), np.float32)] * 2, [0, 0], 0,
                  [0.0, 0.0])
        return True
    except ServerError as err:
        return str(err)


def test_a_pooled_connection_the_server_closed_while_idle_is_not_used(in_process):
    in_process.data_plane.idle_timeout_s = 1.0
    in_process.service.data_idle_timeout_s = 1
    with PSClient([in_process.address], ClientOptions(retries=0)) as client:
        _train(_tables(client, "idle_"), steps=1)
        time.sleep(2.0)
        _train(_tables(client, "idle2_"), steps=1)  # retries=0: a stale connection would fail


def test_a_moment_of_crowding_does_not_send_a_client_to_grpc_for_good(in_process, monkeypatch):
    from parallax.client import connection
    monkeypatch.setattr(connection, "PLANE_RETRY_S", 0.5)
    host, port = "127.0.0.1", in_process.data_plane.port
    crowd = [socket.create_connection((host, port)) for _ in range(64)]
    time.sleep(0.3)
    with PSClient([in_process.address]) as client:
        _train(_tables(client, "crowd_"), steps=1)  # over gRPC while the crowd stays
        assert client.servers[0].data_plane is None
        for sock in crowd:
            sock.close()
        time.sleep(1.0)
        _train(_tables(client, "later_"), steps=1)
        assert client.servers[0].data_plane is not None


def test_over_the_limits_is_resource_exhausted_over_tls_and_for_answers(creds):
    token = read_token(creds.token_file)
    options = ClientOptions(tls_ca=str(creds.ca_cert), tls_cert=str(creds.client_cert),
                            tls_key=str(creds.client_key), token=token, retries=0)
    with LocalCluster(1, extra_args=[*creds.server_args(), "--max-message-mb", "1"]) as cluster:
        with PSClient(cluster.addresses, options) as client:
            plane = client.servers[0].data_plane_of()
            with pytest.raises(grpc.RpcError) as info:
                plane.call("PushMany", bytes(8 << 20), 10.0)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert client.servers[0].data_plane is not None  # not forgotten
    with LocalCluster(1) as cluster:
        small = ClientOptions(max_message_mb=1, retries=0)
        with PSClient(cluster.addresses, small) as client:
            client.create_table(TableSpec(name="big", vocabulary_size=40_000, dim=16))
            body = packed_codec.encode_pull_many(["big"], [0], [0], [np.arange(40_000)])
            plane = client.servers[0].data_plane_of()
            with pytest.raises(grpc.RpcError) as info:
                plane.call("PullMany", body, 10.0)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            assert not getattr(info.value, "transport", True)


@pytest.mark.parametrize("method", [1, 2])
def test_a_retired_protobuf_frame_is_an_unknown_method_and_the_plane_serves_on(in_process,
                                                                              method):
    """Methods 1 and 2 (PullMany and PushMany as protobuf bytes) are retired: a frame naming
    one is answered with the unknown-method error, its connection closed, and packed frames
    (3 and 4) keep being served."""
    sock = _hello(f"127.0.0.1:{in_process.data_plane.port}")
    try:
        dataplane.read_header(sock, dataplane.RESPONSE)
        dataplane.recv_exact(sock, dataplane.SERVER_ID.size)
        body = ps_pb2.PullManyRequest().SerializeToString() + b"\x00" * 8
        sock.sendall(dataplane.REQUEST.pack(dataplane.MAGIC, method, 10.0, len(body)) + body)
        status, length = dataplane.read_header(sock, dataplane.RESPONSE)
        details = dataplane.recv_exact(sock, length).decode()
    finally:
        sock.close()
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0], details
    assert f"unknown data-plane method {method}" in details and "[3, 4]" in details
    with PSClient([in_process.address]) as client:
        _train(_tables(client, f"retired{method}_"), steps=1)
        assert client.servers[0].data_plane is not None


def test_a_malformed_packed_frame_is_refused_and_changes_nothing(servers):
    with PSClient(servers.addresses) as client:
        tables = _tables(client, "packed_bad_")
        before = _train(tables, steps=1)
        plane = DataPlaneClient(*servers.addresses[0].rsplit(":", 1)[:1],
                                client.servers[0].data_plane_of().port, ClientOptions())
        try:
            header = PushHeader(tables[0].name, 0, 1, 0, 0.5, 0, 1, tables[0].session)
            body = PushManyParts([(header, 2, DIM, np.float32)],
                                 lambda i, ids, g: (ids.__setitem__(..., [0, 2]),
                                                    g.__setitem__(..., 1.0))).packed()
            with pytest.raises(grpc.RpcError) as err:
                plane.call("PushMany", body[:-4], 10.0)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed data-plane request: packed PushManyRequest" in err.value.details()
        finally:
            plane.close()
        after = pull_many(tables, [np.arange(VOCAB)] * 2, [1, 1])
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)


def test_the_data_plane_answer_is_unchanged_on_the_wire(servers):
    """Framing version 1 and `packed` (now always true), as every release has announced them
    since packed frames came (a version 2 sent clients to gRPC for good: a reviewer's
    finding)."""
    with PSClient(servers.addresses) as client:
        reply = client.servers[0].stub().DataPlane(ps_pb2.DataPlaneRequest(), timeout=10)
    assert (reply.version, reply.packed) == (1, True) and reply.port


@pytest.mark.parametrize("given", [0.0, float("nan"), float("inf"), -5.0, 1e12])
def test_a_frames_deadline_is_held_to_the_servers_maximum(given):
    """Issue 29, item 13: a frame whose deadline was NaN, inf, negative, 0 or huge waited
    (a pull for its step) without a server-side bound; now at most MAX_DEADLINE_S."""
    from parallax_ps.dataplane import MAX_DEADLINE_S, _Context
    remaining = _Context(given).time_remaining()
    assert 0 < remaining <= MAX_DEADLINE_S
    assert _Context(2.0).time_remaining() <= 2.0  # a sensible deadline is kept


# ---- server identity without a data plane ---------------------------------------------------
def _identity(address: str) -> ps_pb2.DataPlaneResponse:
    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        return stub.DataPlane(ps_pb2.DataPlaneRequest(), timeout=10)


@pytest.mark.parametrize("args", [[], ["--data-port", "-1"]], ids=["data_plane", "none"])
def test_every_server_process_answers_its_own_nonzero_id(args):
    """DataPlaneResponse.server_id is one random nonzero id per server process, with or
    without a data plane (port 0 still means none), and the data plane's hello answers the
    same one: two servers, and a server started again on its port, answer different ids."""
    with LocalCluster(2, extra_args=args) as cluster:
        first = [_identity(address) for address in cluster.addresses]
        os.kill(cluster.servers[0].proc.pid, signal.SIGKILL)
        cluster.servers[0].proc.wait(10)
        cluster.replace(0)
        again = _identity(cluster.addresses[0])
    ids = [reply.server_id for reply in (*first, again)]
    assert all(ids) and len(set(ids)) == 3, ids
    assert all(bool(reply.port) == (not args) for reply in (*first, again))
    if args:
        return
    host = cluster.addresses[0].rsplit(":", 1)[0]
    with LocalCluster(1) as cluster:  # (the hello: the same id, and no other)
        reply = _identity(cluster.addresses[0])
        plane = DataPlaneClient(host, reply.port, ClientOptions(timeout=5), reply.server_id)
        plane.check()
        plane.close()
        other = DataPlaneClient(host, reply.port, ClientOptions(timeout=5), reply.server_id ^ 1)
        with pytest.raises(grpc.RpcError) as refused:
            other.check()
        other.close()
    assert "another server" in refused.value.details()


def test_a_call_asking_for_another_server_process_is_refused_and_not_retried():
    """`parallax-server-id` metadata (server_identity): a call asking for this process, or
    for none, is served; one asking for another (a client whose shards were on the process
    before a restart) is refused UNAVAILABLE naming it, before its handler, streaming calls
    too, and the client's connection does not retry it (Stats asks for any process)."""
    from parallax.protocol import server_identity
    with LocalCluster(1) as cluster:
        address = cluster.addresses[0]
        mine = _identity(address).server_id
        unknown = ps_pb2.StepRequest(table="nowhere")
        with grpc.insecure_channel(address) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            for asked, code in ((mine, grpc.StatusCode.NOT_FOUND), (0, grpc.StatusCode.NOT_FOUND),
                                (mine ^ 1, grpc.StatusCode.UNAVAILABLE)):
                with pytest.raises(grpc.RpcError) as answer:
                    stub.WaitStep(unknown, timeout=10, metadata=server_identity.metadata(asked))
                assert answer.value.code() == code
            assert server_identity.replaced(answer.value.details())
            with pytest.raises(grpc.RpcError) as refused:
                stub.InitRows(iter([ps_pb2.InitRowsChunk()]), timeout=10,
                              metadata=server_identity.metadata(mine ^ 1))
            assert server_identity.replaced(refused.value.details())
        conn = ServerConnection(address, ClientOptions(timeout=5, retries=5, backoff=2.0))
        conn.expected = lambda: mine ^ 1
        started = time.monotonic()
        with pytest.raises(ServerError, match=server_identity.REPLACED):
            conn.call("WaitStep", unknown)
        assert time.monotonic() - started < 1.0  # (five retries would wait seconds)
        assert conn.data_plane_of(mine ^ 1) is None  # and its data plane is not used
        conn.call("Stats", ps_pb2.StatsRequest())
        conn.expected = lambda: mine
        assert conn.data_plane_of(mine) is not None
        conn.close()
