"""A held save's request rounds (`PSClient.save(held=True)`, then `hold_state`), counted by
the real servers' own Stats counters on loopback: one PREPARE per server, which also drops
the marks past `keep`, then one request per state piece; no COMMIT and no Stats round. What
the rounds left out did stays done: a failed save keeps the newest mark before it, and the
servers the state goes to are learnt again from each save's answers."""
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


def _step(table, step: int) -> None:
    table.push(np.arange(0, 300, 7), np.ones((43, 4), np.float32), step=step, worker=0)
    table.wait_step(step + 1)


def _commit(client: PSClient, path: str, table, state: bytes) -> str:
    """A held save of the table with `state` beside it, as a held backup makes; its name."""
    name = client.save(path, [table.name], keep=2, held=True)[0].checkpoint
    client.hold_state(path, [table.name], name, state, keep=2)
    return name


def _requests(client: PSClient) -> list[dict[str, int]]:
    """{method: requests} each live server has answered (this Stats request not yet)."""
    return [{m.method: m.requests for m in server.call("Stats", ps_pb2.StatsRequest()).methods}
            for server in client.live_servers()]


def _added(before: list[dict], after: list[dict], method: str) -> list[int]:
    return [a.get(method, 0) - b.get(method, 0) for b, a in zip(before, after)]


def test_a_held_save_and_its_state_take_one_request_per_server_each(client, table_name):
    table = client.create_table(_spec(table_name))
    _step(table, 0)
    before = _requests(client)
    name = _commit(client, table_name, table, _state(1000, 1))  # a piece a server
    after = _requests(client)
    assert _added(before, after, "Save") == [2, 2]  # PREPARE with keep, then its piece
    assert _added(before, after, "Stats") == [1, 1]  # (the first _requests' own)
    assert client.held_state(table_name) == (name, _state(1000, 1))

    other = PSClient(client.addresses, client.options)  # no save of its own: it asks
    with other:
        before = _requests(client)
        other.hold_state(table_name, [table.name], name, _state(1000, 2), keep=2)
        after = _requests(client)
    assert _added(before, after, "Stats") == [2, 2]
    assert client.held_state(table_name) == (name, _state(1000, 2))


def test_keep_in_the_one_round_drops_marks_and_pieces_and_a_failed_save_keeps_the_last(
        client, table_name):
    """keep=2 at every PREPARE: the third save drops the first's mark and state on every
    server. A save a server refuses (a keyed table there) is aborted on the others, which
    had marked it and dropped the marks past keep: the newest save before it stays held,
    with its state."""
    table = client.create_table(_spec(table_name))
    names = []
    for step in range(3):
        _step(table, step)
        names.append(_commit(client, table_name, table, _state(MIB, step)))
    assert not client.holds([table.name], names[0])
    assert client.holds([table.name], names[1]) and client.holds([table.name], names[2])
    listed = ps_pb2.RestoreRequest(path=table_name, held=True, verify_only=True)
    kept = {p.checkpoint for server in client.servers
            for p in server.call("Restore", listed).states}
    assert kept == {names[1], names[2]}

    keyed = client.create_table(TableSpec(name=f"{table_name}_keyed", hashed_keys=True, dim=2,
                                          shard_count=1), placement=[1])
    with pytest.raises(ServerError, match="keyed: held checkpoints keep fixed-vocabulary"):
        client.save(table_name, [table.name, keyed.name], keep=2, held=True)
    assert client.holds([table.name], names[2])
    assert client.held_state(table_name) == (names[2], _state(MIB, 2))
    shards = client.restore("", [table.name], names[2], held=True)
    assert {s.step for s in shards} == {3}


def test_the_state_goes_where_each_save_found_the_tables_after_a_lost_server():
    """Replicated shards on 3 servers: a server killed between a save and its state (the
    send to it fails: its pieces' copies hold them), then the next save's state goes to the
    2 servers left, learnt from that save's own answers; both read back whole."""
    options = ClientOptions(timeout=20, retries=3, backoff=0.05, replicas=2)
    with LocalCluster(3) as cluster, PSClient(cluster.addresses, options) as client:
        table = client.create_table(_spec("relearnt"))
        _step(table, 0)
        name = client.save("job", [table.name], keep=2, held=True)[0].checkpoint
        victim = cluster.servers[1].proc
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        client.hold_state("job", [table.name], name, _state(3 * MIB + 1, 3), keep=2)
        assert client.held_state("job") == (name, _state(3 * MIB + 1, 3))

        _step(table, 1)
        before = _requests(client)
        second = _commit(client, "job", table, _state(MIB, 4))
        after = _requests(client)
        assert _added(before, after, "Save") == [3, 3]  # its PREPARE, 2 pieces (and copies)
        assert _added(before, after, "Stats") == [1, 1]  # (the first _requests' own)
        assert client.holds([table.name], second)
        assert client.held_state("job") == (second, _state(MIB, 4))
