"""The data plane (parallax.dataplane): PullMany and PushMany as frames on the server's data
port, against real servers. The same requests give the same answers as over gRPC; TLS,
mutual TLS and the token guard it as they guard gRPC; a server without it, or whose data
port cannot be reached, is served over gRPC; a waiting pull holds only its own connection.
The fuzzer (tests/test_fuzz.py) sends it every fuzz case of both methods, and frames that
are no requests.
"""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.dataplane import DataPlaneClient
from parallax.client.many import pull_many, push_many
from parallax.errors import ServerError
from parallax.local_cluster import LocalCluster
from parallax.security import generate_job_credentials, read_token
from parallax.specs import Adagrad, SGD, TableSpec

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
