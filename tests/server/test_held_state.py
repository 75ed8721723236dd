"""A held checkpoint's state (`PSClient.hold_state`, servers/parallax_ps/held_state.py): bytes
split over real server processes beside the tables' marks, read back whole, dropped with the
marks, counted against --memory-mb, and kept through a server's death with replicated shards."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.errors import ServerError
from parallax.protocol.specs import Adagrad, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2

MIB = 1 << 20


def _spec(name: str, shards: int = 3) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=300, dim=4, shard_count=shards,
                     optimizer=Adagrad(0.1), initializer=Initializer("uniform", seed=3),
                     num_workers=1)


def _state(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()


def _commit(client: PSClient, path: str, table, step: int, state: bytes) -> str:
    """A step, then a held save of the table with `state` beside it; its name."""
    table.push(np.arange(0, 300, 7), np.ones((43, 4), np.float32), step=step, worker=0)
    table.wait_step(step + 1)
    name = client.save(path, [table.name], keep=2, held=True)[0].checkpoint
    client.hold_state(path, [table.name], name, state, keep=2)
    return name


def _kept(client: PSClient, path: str) -> list[int]:
    """Bytes of state each server keeps under `path`."""
    request = ps_pb2.RestoreRequest(path=path, held=True, verify_only=True)
    return [sum(p.bytes for p in server.call("Restore", request).states)
            for server in client.live_servers()]


def test_a_held_state_is_split_over_the_servers_read_back_whole_and_dropped_with_its_mark(
        client, table_name):
    table = client.create_table(_spec(table_name))
    assert client.held_state(table_name) is None
    states = [_state(9 * MIB + 5, seed) for seed in range(3)]  # 4 MiB pieces at most: 3
    first = _commit(client, table_name, table, 0, states[0])
    assert client.held_state(table_name) == (first, states[0])
    assert 0 < max(_kept(client, table_name)) < len(states[0])  # no server holds it all
    second = _commit(client, table_name, table, 1, states[1])
    assert client.held_state(table_name) == (second, states[1])
    client.drop_held([table_name], second)  # (a backup on disk made it useless)
    assert client.held_state(table_name) == (first, states[0])
    _commit(client, table_name, table, 2, states[2])
    client.restore("", [table_name], first, held=True)  # past the third: its state goes
    assert client.held_state(table_name) == (first, states[0])
    assert sum(_kept(client, table_name)) == len(states[0])
    for step in (1, 2, 3):  # keep=2: the oldest mark and its state go
        name = _commit(client, table_name, table, step, states[step % 3])
    assert client.held_state(table_name) == (name, states[0])
    assert sum(_kept(client, table_name)) == len(states[2]) + len(states[0])
    client.save(f"{table_name}-disk", [table_name])
    client.restore(f"{table_name}-disk", [table_name])  # a restore from disk drops the marks
    assert client.held_state(table_name) is None and _kept(client, table_name) == [0, 0]


def test_a_state_piece_needs_its_mark_and_goes_with_its_table(client, table_name):
    table = client.create_table(_spec(table_name))
    name = client.save(table_name, [table.name], held=True)[0].checkpoint
    client.drop_held([table.name], name)
    with pytest.raises(ServerError, match="which .* does not hold: send it after the save's "
                                          "PREPARE"):
        client.hold_state(table_name, [table.name], name, b"state")
    name = _commit(client, table_name, table, 0, b"state")
    assert client.held_state(table_name) == (name, b"state")
    client.delete_table(table)
    assert client.held_state(table_name) is None and _kept(client, table_name) == [0, 0]


def test_held_state_counts_against_memory_mb():
    """One server under --memory-mb 24 (its baseline is not counted under so small a limit):
    a second 12 MiB state beside the first does not fit, and fits once the first's mark is
    dropped."""
    with LocalCluster(1, extra_args=["--memory-mb", "24"]) as cluster, \
            PSClient(cluster.addresses, ClientOptions(timeout=20)) as client:
        table = client.create_table(_spec("budget", shards=1))
        first = _commit(client, "a", table, 0, _state(12 * MIB, 1))
        with pytest.raises(ServerError, match=r"RESOURCE_EXHAUSTED.*would bring the held "
                                              r"state this server keeps to 24.0 MiB.*"
                                              r"limit of 24.0 MiB \(--memory-mb\); raise "
                                              r"--memory-mb or add servers"):
            _commit(client, "b", table, 1, _state(12 * MIB, 2))
        assert client.held_state("b") is None  # (its pieces refused: none of them whole)
        assert client.held_state("a")[0] == first
        client.drop_held([table.name], first)
        second = _commit(client, "b", table, 2, _state(12 * MIB, 2))
        assert client.held_state("b")[0] == second


def test_a_held_state_outlives_a_killed_server_with_replicas():
    options = ClientOptions(timeout=20, retries=3, backoff=0.05, replicas=2)
    state = _state(3 * MIB + 1, 4)
    with LocalCluster(3) as cluster, PSClient(cluster.addresses, options) as client:
        table = client.create_table(_spec("replicated"))
        name = _commit(client, "job", table, 0, state)
        victim = cluster.servers[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        assert client.holds([table.name], name)
        assert client.held_state("job") == (name, state)


def test_a_state_goes_only_to_the_servers_holding_the_tables(client, table_name):
    """A one-shard table on one of the two servers: its state goes to that server alone
    (the other has no mark to drop it with: its pieces outlived every job before), and it
    goes with the table."""
    table = client.create_table(_spec(table_name, shards=1), placement=[1])
    state = _state(MIB + 3, 5)
    name = _commit(client, table_name, table, 0, state)
    assert client.held_state(table_name) == (name, state)
    assert _kept(client, table_name) == [0, len(state)]
    request = ps_pb2.SaveRequest(path=table_name, tables=[table.name], checkpoint=name,
                                 held=True, phase=ps_pb2.SAVE_COMMIT, keep=2,
                                 state=ps_pb2.StatePiece(checkpoint=name, count=1, data=b"x"))
    with pytest.raises(ServerError, match="FAILED_PRECONDITION.*of which this server holds "
                                          "no shard: send it to the servers that do"):
        client.servers[0].call("Save", request)
    client.delete_table(table)
    assert _kept(client, table_name) == [0, 0]


@pytest.mark.parametrize("change, error", [
    ({"data": b""}, "no data"),
    ({"checkpoint": "ckpt-00000000000000000001-aaaaaaaa"}, "it names 'ckpt-0"),
    ({"count": 3}, "whose pieces here count 1: send every piece of one state with the same")])
def test_a_bad_state_piece_is_refused_and_spoils_nothing(client, table_name, change, error):
    table = client.create_table(_spec(table_name, shards=1), placement=[0])
    state = _state(MIB, 6)  # in one piece: one server holds the table
    name = _commit(client, table_name, table, 0, state)
    piece = {"checkpoint": name, "index": 1, "count": 2, "data": b"spoiler", **change}
    request = ps_pb2.SaveRequest(path=table_name, tables=[table.name], checkpoint=name,
                                 held=True, phase=ps_pb2.SAVE_COMMIT, keep=2,
                                 state=ps_pb2.StatePiece(**piece))
    with pytest.raises(ServerError, match=f"INVALID_ARGUMENT.*{error}"):
        client.servers[0].call("Save", request)
    assert client.held_state(table_name) == (name, state)


def test_pieces_fit_the_servers_message_limit():
    """Client and servers at --max-message-mb 1: a 3 MiB state goes in pieces that fit the
    servers' limit with the request's own fields (it was refused: 1048672 > 1048576)."""
    state = _state(3 * MIB, 7)
    with LocalCluster(2, extra_args=["--max-message-mb", "1"]) as cluster, \
            PSClient(cluster.addresses, ClientOptions(timeout=20, max_message_mb=1)) as client:
        table = client.create_table(_spec("limits", shards=2))
        name = _commit(client, "limits", table, 0, state)
        assert client.held_state("limits") == (name, state)
