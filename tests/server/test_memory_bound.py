"""`--memory-mb` bounds the server's memory: tables and requests in flight together (issue 29).

One real server process under `--memory-mb 256` holds a 1M x 16 Adagrad table (128 MiB of
rows and slots, every row written), then takes the issue's workloads: one PushMany of 2.5M
rows (180 MB) and six concurrent pulls of 2M ids each (128 MB answers), which do not fit
beside the table and are refused RESOURCE_EXHAUSTED naming the sizes, plus six concurrent
pulls that fit one or two at a time, which wait for room and all succeed. Its peak resident
memory during each workload (VmHWM of the process, reset once the table is filled: the fill's
own peak is printed) stays within 1.25x --memory-mb on the data plane (the client's
default); over gRPC within that plus the six 16 MB request bodies gRPC holds before any
handler can. --memory-mb counts the process's own baseline (the interpreter, numpy and
gRPC, 61-73 MB here, resident before any table) against the requests in flight. On the
commit before, the same workloads peaked at 720 MB (data plane) and 785 MB (gRPC), every
request answered.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.many import pull_many, push_many
from parallax.errors import ServerError
from parallax.protocol.specs import Adagrad, TableSpec

LIMIT_MB = 256
ROWS, DIM = 1_000_000, 16
BOUND_MB = 1.25 * LIMIT_MB
# gRPC reads every request's body before a handler can hold it (the data plane holds it from
# the frame's header): six 16 MB pull requests at once are all resident before the first is
# refused, so the bound there adds those bodies (measured 282-363 MB against the data plane's
# 204-277 MB, on a baseline of 61-73 MB).
GRPC_UNADMITTED_MB = 6 * 2_000_000 * 8 / (1 << 20)
GRPC_BOUND_MB = BOUND_MB + GRPC_UNADMITTED_MB


def _vm(pid: int, field: str) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    """Start the process's VmHWM afresh at its current RSS (Linux's clear_refs 5), so that
    each workload's peak is its own, not the table fill's or an earlier test's."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


@pytest.fixture(scope="module", params=["data-plane", "grpc"])
def server(request):
    """A server, its table filled (steps of 100k rows), its baseline RSS in MB, and whether
    the requests below reach it on the data plane or over gRPC."""
    with LocalCluster(1, extra_args=["--memory-mb", str(LIMIT_MB)]) as cluster, \
            PSClient(cluster.addresses) as client:
        pid = cluster.servers[0].proc.pid
        baseline = _vm(pid, "VmRSS")
        table = client.create_table(TableSpec(name="big", vocabulary_size=ROWS, dim=DIM,
                                              optimizer=Adagrad(learning_rate=0.1)))
        for step, first in enumerate(range(0, ROWS, 100_000)):
            ids = np.arange(first, first + 100_000)
            push_many([table], [ids], [np.ones((len(ids), DIM), np.float32)], [step], 0,
                      [0.1])
        print(f"table filled: peak RSS {_vm(pid, 'VmHWM'):.0f} MB, RSS {_vm(pid, 'VmRSS'):.0f}"
              f" MB (baseline {baseline:.0f} MB)")
        yield {"cluster": cluster, "pid": pid, "baseline": baseline, "spec": table.spec,
               "steps": ROWS // 100_000, "plane": request.param == "data-plane"}
    assert cluster.exit_codes == [0]


def _table(server, **options):
    """A new client of the server and its table, its data plane found already (else calls
    made at once while one asks where it is go over gRPC)."""
    client = PSClient(server["cluster"].addresses,
                      ClientOptions(max_message_mb=256, timeout=120,
                                    data_plane=server["plane"], **options))
    table = client.table(server["spec"])
    pull_many([table], [np.arange(2)], [0])
    assert (client.servers[0].data_plane is not None) == server["plane"]
    _reset_peak(server["pid"])
    return client, table


def _concurrently(count: int, call) -> list[str]:
    errors: list[str] = []

    def run(k: int) -> None:
        try:
            call(k)
        except ServerError as err:
            errors.append(str(err))
    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _report(server, what: str) -> float:
    peak = _vm(server["pid"], "VmHWM")
    what += " (data plane)" if server["plane"] else " (gRPC)"
    print(f"{what}: peak RSS {peak:.0f} MB, RSS after {_vm(server['pid'], 'VmRSS'):.0f} MB "
          f"(baseline {server['baseline']:.0f} MB, --memory-mb {LIMIT_MB}, bound "
          f"{_bound(server):.0f} MB)")
    return peak


@pytest.mark.parametrize("server", ["data-plane"], indirect=True)  # gRPC reads a body
def test_a_push_that_does_not_fit_is_refused_before_it_is_read(server):  # before a handler
    client, table = _table(server, chunk_mb=256)
    with client:
        before = table.pull(np.arange(0, ROWS, 997))
        ids = np.random.default_rng(0).integers(0, ROWS, 2_500_000)
        refused = (r"RESOURCE_EXHAUSTED: .* needs .* MiB of working memory, .* may use "
                   r"256.0 MiB \(--memory-mb\) and its baseline .* and the tables hold .* MiB")
        with pytest.raises(ServerError, match=refused) as info:
            push_many([table], [ids], [np.ones((len(ids), DIM), np.float32)],
                      [server["steps"]], 0, [0.1])
        assert "chunk_mb" in str(info.value)
        np.testing.assert_array_equal(table.pull(np.arange(0, ROWS, 997)), before)
    assert _report(server, "PushMany of 2.5M rows") <= BOUND_MB


def _bound(server) -> float:
    return BOUND_MB if server["plane"] else GRPC_BOUND_MB


def test_concurrent_pulls_that_do_not_fit_are_refused(server):
    client, table = _table(server, chunk_mb=256)
    with client:
        errors = _concurrently(6, lambda k: pull_many(
            [table], [np.random.default_rng(k).integers(0, ROWS, 2_000_000)], [0]))
    assert len(errors) == 6 and all("RESOURCE_EXHAUSTED" in e and "--memory-mb" in e
                                    for e in errors), errors
    assert _report(server, "six 2M-id pulls") <= _bound(server)


def test_concurrent_pulls_that_fit_one_at_a_time_wait_for_room(server):
    """Each answer (300k rows, 19.2 MB) fits beside the table, over gRPC too (which keeps a
    copy of its own until sent: 400k rows did not fit there beside a 73 MB baseline); six at
    once do not: they wait for room and all get their rows."""
    client, table = _table(server, chunk_mb=256)
    results = {}
    with client:
        errors = _concurrently(6, lambda k: results.setdefault(k, pull_many(
            [table], [np.arange(k * 100_000, k * 100_000 + 300_000) % ROWS], [0])))
    assert errors == []
    assert all(results[k][0].shape == (300_000, DIM) for k in range(6))
    assert _report(server, "six 300k-id pulls") <= _bound(server)


def test_a_containers_default_budget_leaves_headroom_below_its_limit(tmp_path):
    """Without --memory-mb a server in a container took its whole memory limit as its budget,
    so tables filling the budget left nothing for a step's requests (OOM-killed)."""
    from parallax_ps.server import memory_budget
    limit = tmp_path / "memory.max"
    limit.write_text(f"{4 << 30}\n")
    assert memory_budget(None, (str(limit),)) == 3 << 30
    assert memory_budget(512, (str(limit),)) == 512 << 20
    limit.write_text("max\n")
    assert memory_budget(None, (str(limit),)) > 0  # no cgroup limit: the machine's RAM


def test_the_baseline_counts_up_to_half_the_limit():
    """A fresh install's baseline (73 MB: more of its libraries' pages in the page cache)
    was not counted under --memory-mb 256 (a quarter at most), an older one's (61 MB) was:
    the same push was refused from its size on one machine and read first on the other."""
    from parallax_ps.budget import MemoryBudget
    mib = 1 << 20
    assert MemoryBudget(256 * mib, 73 * mib).baseline == 73 * mib
    assert MemoryBudget(256 * mib, 61 * mib).baseline == 61 * mib
    assert MemoryBudget(64 * mib, 61 * mib).baseline == 0  # a test's tiny limit


def test_a_far_deadline_waits_for_room_without_overflowing():
    """gRPC gives a call without a deadline ~9.2e18 s remaining; one wait that long raised
    OverflowError (answered INTERNAL, with a logged traceback) once the budget was full."""
    import time
    from parallax_ps.budget import MemoryBudget
    budget = MemoryBudget(100, 0)
    assert budget.hold(80, time.monotonic() + 1, "first")
    got = []
    waiter = threading.Thread(target=lambda: got.append(
        budget.hold(50, time.monotonic() + 9.2e18, "second")))
    waiter.start()
    time.sleep(0.2)
    budget.unhold(80)
    waiter.join(10)
    assert got == [True]


def test_a_grpc_pull_waiting_for_its_step_holds_no_memory():
    """A sync pull over gRPC holds its ids' room (from its size) only while it is decoded:
    waiting for its step it holds nothing, so the push that closes the step finds room."""
    import time
    from concurrent import futures
    import grpc
    from parallax.protocol import wire
    from parallax.ps.v1 import ps_pb2, ps_pb2_grpc
    from parallax_ps.service import ParameterServerService, add_to_server
    service = ParameterServerService(None, 64 << 20, memory_bytes=256 << 20)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        spec = TableSpec(name="sync", vocabulary_size=1000, dim=4, num_workers=2)
        stub.CreateTable(ps_pb2.CreateTableRequest(spec=spec.to_proto(), shard_index=0))
        idle = service.budget.accounted()
        request = ps_pb2.PullManyRequest()
        part = request.parts.add(table="sync", shard_index=0, min_step=1)
        wire.encode(np.arange(1000, dtype=np.int64), part.ids)
        waiting = stub.PullMany.future(request, timeout=30)
        time.sleep(0.5)  # decoded, and waiting for step 1
        assert not waiting.done()
        assert service.budget.accounted() == idle
        waiting.cancel()
    finally:
        server.stop(0).wait()
        service.close()
