"""Wire fuzzer: every RPC of ParameterServer, hit with mutated, truncated, random and
structurally valid but hostile requests (tests/helpers/wire_fuzz.py), against a real server process.

PullMany and PushMany cases go to the data plane too (as frames on the server's data port,
parallax.protocol.dataplane, in parallax.protocol.packed_codec's layout, as is and with
hostile headers, lengths and counts), and frames that are no requests at all (bad magic,
unknown or retired methods, lengths past the limit, truncated bodies, wrong tokens) must be
refused or dropped without harm.

A fixed seed and a bounded count keep it reproducible and quick enough for CI. Afterwards:
no request got INTERNAL or UNKNOWN (every refusal names a specific code), no request aimed at
a protected table was accepted, every protected table (fixed and keyed, sync and async,
optimizers with slots) has exactly its rows, slots and step of before, and the server is
alive, healthy, serves a normal push and pull, stayed within a memory bound, logged no
traceback and exits 0. A failure names the case (its index and what was done) to replay it.
"""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

import wire_fuzz
from conftest import Snapshot
from parallax.client import ClientOptions, PSClient, ServerConnection
from parallax.client.dataplane import DataPlaneClient
from parallax import native
from parallax.client.local_cluster import LocalCluster
from parallax.env import NATIVE_ENV
from parallax.protocol import dataplane, packed_codec
from parallax.protocol.specs import SGD, TableSpec
from parallax.ps.v1 import ps_pb2
from parallax_ps.service import SERVICE_NAME, WAITING_METHODS

SEED = 20240613
PER_METHOD = 300  # cases of each method
RSS_GROWTH_MB = 300  # what fuzzing may add to the server's resident memory
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
            grpc.StatusCode.DATA_LOSS}
SERVER_ARGS = ["--max-message-mb", "4", "--memory-mb", "512", "--threads", "256"]


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str = ""
    response: bytes | None = None


@dataclass
class Server:
    cluster: LocalCluster
    client: PSClient
    channel: grpc.Channel
    data_dir: object
    before: dict[str, Snapshot] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.cluster.servers[0].proc.pid

    def data_port(self) -> int:
        return ps_pb2.DataPlaneResponse.FromString(self.channel.unary_unary(
            f"/{SERVICE_NAME}/DataPlane")(b"", timeout=10)).port


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def send(channel: grpc.Channel, case: wire_fuzz.Case) -> Outcome:
    """The case's raw bytes through a real channel (no serializer on either side)."""
    path = f"/{SERVICE_NAME}/{case.method}"
    timeout = 0.3 if case.method in WAITING_METHODS else 10.0
    try:
        if case.method in wire_fuzz.STREAMING:
            response = channel.stream_unary(path)(iter(case.payload), timeout=timeout)
        else:
            response = channel.unary_unary(path)(case.payload, timeout=timeout)
    except grpc.RpcError as err:
        return Outcome(err.code(), err.details() or "")
    return Outcome(grpc.StatusCode.OK, response=response)


def send_packed(plane: DataPlaneClient, method: str, body: bytes) -> Outcome:
    """`body` as a data-plane frame of `method` (packed: the plane's only layout; a fresh
    connection after any refusal)."""
    timeout = 0.3 if method in WAITING_METHODS else 10.0
    try:
        return Outcome(grpc.StatusCode.OK, response=bytes(plane.call(method, body, timeout)))
    except grpc.RpcError as err:
        return Outcome(err.code(), err.details() or "")


def packed_variants(case: wire_fuzz.Case, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """The case in packed_codec's layout (when its bytes parse as the request), and, for
    cases not aimed at a protected table, that body with hostile changes: bytes of the
    headers and names overwritten, truncated, extended, counts set huge or negative."""
    try:
        body = packed_codec.CLIENT_CODECS[case.method][0](
            ps_pb2.PullManyRequest.FromString(case.payload) if case.method == "PullMany"
            else case.payload)
    except Exception:  # noqa: BLE001 - a malformed case has no packed form
        return []
    variants = [("", body)]
    if case.must_refuse or len(body) < 8:
        return variants
    parts, names = struct.unpack_from("<II", body)
    record = (packed_codec.PULL_PART if case.method == "PullMany"
              else packed_codec.PUSH_PART).itemsize
    head = 8 + parts * record + names
    spoiled = bytearray(body)
    for _ in range(int(rng.integers(1, 4))):
        at = int(rng.integers(0, max(1, head)))
        spoiled[at:at + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
    huge = bytearray(body)
    if parts:
        at = 8 + int(rng.integers(0, parts)) * record + 8 * int(rng.integers(0, record // 8))
        huge[at:at + 8] = struct.pack("<q", int(rng.choice([-1, 2**62, 2**31, -2**63])))
    cut = int(rng.integers(0, len(body)))
    return variants + [(" spoiled", bytes(spoiled)), (" huge field", bytes(huge)),
                       (f" cut at {cut}", body[:cut]), (" extended", body + b"\0" * 24),
                       (" parts+1", struct.pack("<I", parts + 1) + body[4:])]


def problem(case: wire_fuzz.Case, outcome: Outcome, packed: bool = False) -> str | None:
    """What is wrong with a case's outcome, or None."""
    if outcome.code == grpc.StatusCode.OK:
        if case.must_refuse:
            return "accepted, though aimed at a protected table with a defect"
        output = wire_fuzz.SERVICE.methods_by_name[case.method].output_type.name
        try:
            if packed and case.method == "PullMany":
                packed_codec.decode_pull_many_answer(outcome.response)
            else:
                getattr(ps_pb2, output).FromString(outcome.response)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the finding
            return f"answered bytes that are no {output}: {exc}"
        return None
    if outcome.code not in REFUSALS:
        return f"{outcome.code.name}: {outcome.details[:300]}"
    if "metadata size exceeds" in outcome.details:
        return f"the server's answer was lost (details too long for gRPC): {outcome.details}"
    return None


def _prime(client: PSClient) -> None:
    """Give the victims rows, optimizer slots and steps to lose."""
    tables = {name: client.create_table(spec) for name, spec in wire_fuzz.VICTIMS.items()}
    for name in wire_fuzz.SANDBOX:
        client.create_table(wire_fuzz.SANDBOX[name])
    fixed, hashed, sync = (tables[n] for n in ("victim_fixed", "victim_hashed", "victim_sync"))
    rng = np.random.default_rng(1)
    for step in range(3):
        fixed.push(np.arange(0, 300, 7), rng.normal(size=(43, 4)), step, worker=step % 2)
        hashed.push(wire_fuzz.HASHED_KEYS, rng.normal(size=(7, 3)), step)
    for step in range(2):
        for worker in range(2):
            sync.push(np.arange(worker, 50, 3), rng.normal(size=(len(range(worker, 50, 3)), 2)),
                      step, worker=worker)


@contextlib.contextmanager
def _environment(name: str, value: str):
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name)
        else:
            os.environ[name] = previous


@pytest.fixture(scope="module", params=["1", "0"], ids=["native", "python"])
def server(request, tmp_path_factory):
    """A fuzzed server on each data path: the compiled kernels (where built) and numpy."""
    if request.param == "1" and native.kernels() is None:
        pytest.skip(f"compiled kernels: {native.describe()}")
    data_dir = tmp_path_factory.mktemp("fuzz-data")
    with contextlib.ExitStack() as stack:
        with _environment(NATIVE_ENV, request.param):  # the server process inherits it
            cluster = stack.enter_context(LocalCluster(1, data_dir=data_dir,
                                                       extra_args=SERVER_ARGS))
        with PSClient(cluster.addresses, ClientOptions(timeout=30)) as client:
            _prime(client)
            client.save(wire_fuzz.BASE_CHECKPOINT, list(wire_fuzz.VICTIMS))
            channel = grpc.insecure_channel(cluster.addresses[0], options=[
                ("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20)])
            yield Server(cluster, client, channel, data_dir)
            channel.close()
    assert cluster.exit_codes == [0], f"the fuzzed server exited with {cluster.exit_codes}"


@dataclass
class FuzzRun:
    problems: list[str]
    counts: dict[str, int]
    rss_before: float
    rss_after: float
    seconds: float


@pytest.fixture(scope="module")
def fuzz_run(server) -> FuzzRun:
    """Snapshot the victims, send every case, note what went wrong."""
    server.before = {n: Snapshot(server.client, server.data_dir, n) for n in wire_fuzz.VICTIMS}
    rss_before, start = rss_mb(server.pid), time.monotonic()
    problems, counts, seconds = [], {}, {}
    plane = DataPlaneClient("127.0.0.1", server.data_port(), ClientOptions())
    for index, case in enumerate(wire_fuzz.cases(SEED, PER_METHOD)):
        sent = time.monotonic()
        outcomes = [("", send(server.channel, case))]
        if case.method in dataplane.SERVED:
            rng = np.random.default_rng(SEED + index)
            outcomes += [(f" (packed{label})", send_packed(plane, case.method, body))
                         for label, body in packed_variants(case, rng)]
        seconds[case.method] = seconds.get(case.method, 0.0) + time.monotonic() - sent
        for where, outcome in outcomes:
            counts[outcome.code.name] = counts.get(outcome.code.name, 0) + 1
            found = problem(case, outcome, packed="packed" in where)
            if found:
                problems.append(f"case {index} {case.method}{where} [{case.label[:200]}]: "
                                f"{found}")
        if server.cluster.servers[0].proc.poll() is not None:
            problems.append(f"case {index} {case.method} [{case.label[:200]}]: the server died")
            break
    print(f"\nfuzz: {sum(counts.values())} cases in {time.monotonic() - start:.1f}s: {counts}; "
          f"seconds by method: { {m: round(s, 1) for m, s in seconds.items()} }")
    plane.close()
    return FuzzRun(problems, counts, rss_before, rss_mb(server.pid), time.monotonic() - start)


def test_every_rpc_has_a_fuzz_strategy():
    missing = set(wire_fuzz.METHODS) - set(wire_fuzz.STRATEGIES)
    stale = set(wire_fuzz.STRATEGIES) - set(wire_fuzz.METHODS)
    assert not missing, (f"RPCs without a fuzz strategy in tests/helpers/wire_fuzz.py: "
                         f"{sorted(missing)}")
    assert not stale, f"fuzz strategies for RPCs the proto no longer has: {sorted(stale)}"


def test_every_refusal_is_specific_and_victims_are_refused(fuzz_run):
    shown = "\n".join(fuzz_run.problems[:15])
    assert not fuzz_run.problems, (f"{len(fuzz_run.problems)} fuzz cases went wrong (seed "
                                   f"{SEED}); the first:\n{shown}")
    assert fuzz_run.counts.get("OK", 0) > 0 and len(fuzz_run.counts) > 3, fuzz_run.counts


def test_victim_tables_are_unchanged(server, fuzz_run):
    for name, before in server.before.items():
        before.assert_equal(Snapshot(server.client, server.data_dir, name))


def test_server_stays_healthy(server, fuzz_run):
    assert server.cluster.servers[0].proc.poll() is None, "the server process died"
    conn = ServerConnection(server.cluster.addresses[0])
    try:
        assert conn.healthy(timeout=5), "the health check does not answer SERVING"
    finally:
        conn.close()
    stats = server.client.stats()
    assert set(wire_fuzz.VICTIMS) <= {t.table for s in stats.values() for t in s.tables}
    growth = fuzz_run.rss_after - fuzz_run.rss_before
    assert growth < RSS_GROWTH_MB, (f"the server's RSS grew {growth:.0f} MiB while fuzzed "
                                    f"({fuzz_run.rss_before:.0f} -> {fuzz_run.rss_after:.0f})")


def test_normal_traffic_works_after_fuzzing(server, fuzz_run):
    """Fuzz-created tables go (DeleteTable works), a new table takes a push and a pull."""
    delete = server.channel.unary_unary(f"/{SERVICE_NAME}/DeleteTable")
    for stats in server.client.stats().values():
        for shard in stats.tables:
            if shard.table not in wire_fuzz.VICTIMS:
                request = ps_pb2.DeleteTableRequest(table=shard.table,
                                                    shard_index=shard.shard_index)
                delete(request.SerializeToString(), timeout=10)
    spec = TableSpec(name="after_fuzz", vocabulary_size=10, dim=2, sync_mode="async",
                     optimizer=SGD(learning_rate=0.5))
    table = server.client.create_table(spec)
    start = table.pull(np.arange(10))
    table.push([1, 1, 4], np.ones((3, 2)), step=0)
    expected = start.copy()
    expected[1] -= 1.0  # two pushes of ones at lr 0.5
    expected[4] -= 0.5
    np.testing.assert_allclose(table.pull(np.arange(10)), expected, rtol=1e-6)


def test_server_logged_no_traceback(server, fuzz_run):
    lines = server.cluster.servers[0].lines
    bad = [line for line in lines if "Traceback" in line or " failed" in line]
    assert not bad, "the server logged:\n" + "\n".join(bad[:20])


def _answer(server: Server, method: str, request) -> Outcome:
    return send(server.channel, wire_fuzz.Case(method, request.SerializeToString(), "regression"))


def _restore(path: str) -> ps_pb2.RestoreRequest:
    return ps_pb2.RestoreRequest(path=path, tables=["victim_fixed"], verify_only=True)


def _save(path: str) -> ps_pb2.SaveRequest:
    return ps_pb2.SaveRequest(path=path, checkpoint="ckpt-00000000000000000001-00000001",
                              phase=ps_pb2.SAVE_PREPARE)


def _pull_unknown(name: str) -> ps_pb2.PullRequest:
    return ps_pb2.PullRequest(table=name, ids=wire_fuzz.tensor(np.array([1])))


def _other_shard_count() -> ps_pb2.CreateTableRequest:
    spec = wire_fuzz.VICTIMS["victim_fixed"].to_proto()
    spec.shard_count = 3
    return ps_pb2.CreateTableRequest(spec=spec, shard_index=2)


STEP_TABLE = TableSpec(name="regression_steps", vocabulary_size=10, dim=4, sync_mode="async")


@pytest.fixture
def step_table(server):
    server.client.create_table(STEP_TABLE)  # idempotent


def _import_step(step: int) -> ps_pb2.ShardRows:
    return ps_pb2.ShardRows(table=STEP_TABLE.name, step=step, ids=wire_fuzz.tensor(np.array([1])),
                            values=wire_fuzz.tensor(np.ones((1, 4), np.float32)))


# Defects the fuzzer found, each answered before the fix with the status shown in the comment.
REGRESSIONS = [
    # INTERNAL (ValueError: embedded null byte)
    ("Restore", _restore("a\x00b"), grpc.StatusCode.INVALID_ARGUMENT, "NUL byte"),
    ("Save", _save("a\x00b"), grpc.StatusCode.INVALID_ARGUMENT, "NUL byte"),
    # INTERNAL (OSError: File name too long)
    ("Restore", _restore("z" * 300), grpc.StatusCode.INVALID_ARGUMENT, "component of 300"),
    ("Restore", _restore("d/" * 2100), grpc.StatusCode.INVALID_ARGUMENT, "makes a path of"),
    # RESOURCE_EXHAUSTED from the client's gRPC: the status echoed the 1 MB name, too long
    # for a trailer, and the server's NOT_FOUND never arrived
    ("Pull", _pull_unknown("w" * 1_000_000), grpc.StatusCode.NOT_FOUND, "does not exist"),
    ("Barrier", ps_pb2.BarrierRequest(name="w" * 1_000_000, rank=5, count=2),
     grpc.StatusCode.INVALID_ARGUMENT, "must be in [0, count=2)"),
    # OK: a third shard of a 2-shard table, whose Save then mixed shard counts
    ("CreateTable", _other_shard_count(), grpc.StatusCode.ALREADY_EXISTS,
     "shard_count 2 != 3"),
    # OK, and then every push to the table, Stats and WaitStep answered INTERNAL (step 2**63
    # does not fit the answers' int64)
    ("ImportRows", _import_step(2**63 - 1), grpc.StatusCode.INVALID_ARGUMENT,
     "must be in [0, 4611686018427387904]"),
]


@pytest.mark.parametrize("method, request_, code, text", REGRESSIONS,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(REGRESSIONS)])
def test_fuzz_finding_stays_fixed(server, step_table, method, request_, code, text):
    outcome = _answer(server, method, request_)
    assert outcome.code == code, f"{outcome.code.name}: {outcome.details[:300]}"
    assert text in outcome.details, outcome.details[:300]
    assert len(outcome.details.encode()) <= 4096 + 16


def test_a_step_near_the_bound_still_counts_on(server, step_table):
    """The largest importable step leaves room: a push past it answers, and so does Stats."""
    assert _answer(server, "ImportRows", _import_step(2**62)).code == grpc.StatusCode.OK
    push = ps_pb2.PushRequest(table=STEP_TABLE.name, step=1, session=9,
                              ids=wire_fuzz.tensor(np.array([1])),
                              grads=wire_fuzz.tensor(np.ones((1, 4), np.float32)))
    outcome = _answer(server, "Push", push)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert ps_pb2.PushResponse.FromString(outcome.response).step == 2**62 + 1
    assert _answer(server, "Stats", ps_pb2.StatsRequest()).code == grpc.StatusCode.OK


# ---- frames that are no requests, on the data plane ------------------------------------------
def _frame(method: int, length: int, deadline: float = 0.0) -> bytes:
    return dataplane.REQUEST.pack(dataplane.MAGIC, method, deadline, length)


_HELLO = _frame(dataplane.HELLO, 0)
FRAME_ATTACKS = {
    "bad magic": b"XXXX" + bytes(dataplane.REQUEST.size),
    "a request before the hello": _frame(3, 0),
    "a hello with a 1 MiB token": _frame(dataplane.HELLO, 1 << 20) + bytes(1 << 20),
    "a wrong token": _frame(dataplane.HELLO, 5) + b"wrong",
    "an unknown method": _HELLO + _frame(9, 0),
    "a retired protobuf PullMany (method 1)": _HELLO + _frame(1, 8) + bytes(8),
    "a retired protobuf PushMany (method 2)": _HELLO + _frame(2, 0),
    "a body past the message limit": _HELLO + _frame(4, 1 << 40),
    "a truncated body": _HELLO + _frame(4, 1000) + b"x" * 10,
    "an empty PullMany with a NaN deadline": _HELLO + _frame(3, 0, float("nan")),
    "an empty PushMany with a negative deadline": _HELLO + _frame(4, 0, -5.0),
    "random bytes after the hello": _HELLO + np.random.default_rng(SEED).bytes(300),
}


def _exchange(port: int, data: bytes) -> list[tuple[int, bytes]]:
    """Send `data` on a new connection, close our side, and read every response frame."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # a broken pipe, a reset, not connected any more
            pass  # the server stopped reading (it refused what came first): read its answer
        frames = []
        while True:
            try:
                status, length = dataplane.read_header(sock, dataplane.RESPONSE)
                frames.append((status, bytes(dataplane.recv_exact(sock, length))))
            except (EOFError, OSError):  # closed, or reset, by the server
                return frames


@pytest.mark.parametrize("label", sorted(FRAME_ATTACKS))
def test_data_plane_frames_that_are_no_requests_are_refused(server, label):
    allowed = {0, grpc.StatusCode.UNAUTHENTICATED.value[0]} | {c.value[0] for c in REFUSALS}
    frames = _exchange(server.data_port(), FRAME_ATTACKS[label])
    assert all(status in allowed for status, _ in frames), frames
    assert server.cluster.servers[0].proc.poll() is None
    assert ServerConnection(server.cluster.addresses[0]).healthy()


def test_data_plane_serves_after_the_attacks(server):
    table = server.client.create_table(TableSpec(name="after_frames", vocabulary_size=20, dim=2,
                                                 optimizer=SGD(1.0)))
    from parallax.client.many import pull_many, push_many
    push_many([table], [np.arange(4)], [np.ones((4, 2), np.float32)], [0], 0, [1.0])
    rows = pull_many([table], [np.arange(4)], [1])[0]
    before = table.pull_unique(np.arange(4))
    np.testing.assert_array_equal(rows, before)
    assert table.shards[0].data_plane is not None  # these went through the data plane
