"""The ParameterServer gRPC service: decode, hand to the shard, encode, count.

Each handler turns every rejection into a precise gRPC status: `RequestError` carries its own
code, spec and wire errors are INVALID_ARGUMENT, anything unexpected is INTERNAL and logged.

RPCs that may wait (`WAITING_METHODS`: sync pulls until their step closes, barriers, and
InitRows streams as long as the client streams) run on a pool of their own (`--threads`),
so they can never take the threads that pushes, health checks, stats and control RPCs run
on (`--reserved-threads`): a stuck step cannot starve the push that would close it. A sync
table is refused at creation when its workers could hold more waiting pulls at once than
that pool has threads (every worker may wait on every shard).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

from parallax.errors import ConfigError
from parallax.protocol import bulk_codec, dataplane, packed_codec, wire
from parallax.protocol.specs import TableSpec
from parallax.ps.v1 import ps_pb2, ps_pb2_grpc
from parallax.version import PROTOCOL_VERSION, __version__
from parallax_ps import checkpoint, inflight, many, versions, waits
from parallax_ps.barrier import Barriers
from parallax_ps.budget import MemoryBudget
from parallax_ps.errors import RequestError, bounded, invalid
from parallax_ps.held_state import HeldStates
from parallax_ps.shard import TableShard
from parallax_ps.stats import ServerStats

log = logging.getLogger("parallax_ps")
SERVICE_NAME = "parallax.ps.v1.ParameterServer"
WAITING_METHODS = frozenset({"Pull", "PullMany", "WaitStep", "Barrier", "InitRows"})
MAX_PARTS_PER_SHARD = 4  # parts of one PullMany/PushMany, per table shard held


NO_DEADLINE_S = 10.0 ** 9  # gRPC's time_remaining() of a call without a deadline: ~9.2e18


def _deadline(context: grpc.ServicerContext) -> float | None:
    """When a waiting request gives up: a little before the caller's own deadline, so the
    caller gets the server's explanation (who has not pushed) rather than a bare timeout;
    None for a call without one (gRPC says ~9.2e18 s, which no wait accepts). A data-plane
    request parked and run again keeps the deadline of its first attempt (`wait_until`)."""
    known = getattr(context, "wait_until", None)
    if known is not None:
        return known
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        return None
    until = time.monotonic() + remaining - min(0.25, 0.1 * remaining)
    if hasattr(context, "wait_until"):
        context.wait_until = until
    return until


def _status_of(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a handler's exception answers with (details short enough to arrive)."""
    if isinstance(exc, RequestError):
        return exc.code, bounded(exc.message)
    if isinstance(exc, (ConfigError, wire.WireError)):
        return grpc.StatusCode.INVALID_ARGUMENT, bounded(str(exc))
    log.error("%s failed", method, exc_info=exc)  # a bug: keep serving, tell the client
    return grpc.StatusCode.INTERNAL, bounded(f"{method}: {type(exc).__name__}: {exc}")


class Undecodable:
    """A request whose bytes did not parse: answered INVALID_ARGUMENT by its handler (gRPC
    itself would answer a deserializer's exception with INTERNAL)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class Unread:
    """A bulk request's bytes as gRPC received them, decoded only once their working memory
    is held against --memory-mb (`_admitted`): a protobuf parse would copy them first, so
    six concurrent 16 MB pulls held 2 copies each before the first was refused."""
    __slots__ = ("raw", "parse")

    def __init__(self, raw: bytes, parse) -> None:
        self.raw, self.parse = raw, parse


def _admitted(method: str, request, context):
    """The decoded request, once an `Unread` one's working memory (from its size:
    `inflight.frame_need`) is held in this request's scope (waiting for room until the
    call's deadline, else RESOURCE_EXHAUSTED); INVALID_ARGUMENT if it does not parse.
    Unlike a data-plane frame's, its body holds no floor while it waits for its answer's
    room: six waiting 400k-id pulls each holding 3.2 MB left none of them the room to go
    on (each waited out its deadline). Once decoded it holds nothing until its answer's
    room is taken (`many.hold_answer`), after any wait for its step: sync pulls waiting
    for a step while holding their ids' room could leave the push that closes the step
    none."""
    if isinstance(request, Unread):
        raw, request.raw = request.raw, None
        inflight.ensure(inflight.frame_need(method, len(raw)),
                        _deadline(context) if context is not None else None,
                        f"{method} of {len(raw)} bytes")  # (no floor: see `Scope.floor`)
        request = request.parse(raw)
        del raw
        inflight.give_back_held()  # decoded: nothing is held while it waits for its step
    _check_decoded(request)
    return request


def _until_cancelled(request_iterator):
    """A client stream's requests; CANCELLED once gRPC reports the client cancelled it (not
    a server fault to log as INTERNAL). gRPC Python's server can instead end a cancelled
    stream as if the client had finished it: the cancellation and the end of its messages
    arrive as two events, and the handler may read between them (grpc/grpc#33038; a quarter
    of cancelled InitRows streams under load), so a stream is whole only once the client
    says so (`InitRowsChunk.last`): without that, a cancelled stream's rows were put in."""
    try:
        yield from request_iterator
    except grpc.RpcError:  # (gRPC's iterator raises a bare one for a cancelled call)
        raise RequestError(grpc.StatusCode.CANCELLED, "the client cancelled the stream; "
                           "nothing of it was applied") from None


def _tolerant(deserialize, name: str):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's
            return Undecodable(f"malformed {name}: {exc}")
    return parse


def _check_decoded(request) -> None:
    if isinstance(request, Undecodable):
        raise invalid(request.reason)


def _rpc(method: str):
    """Wrap a handler returning (response, table, rows, bytes) with stats and error mapping."""
    def decorate(fn):
        @functools.wraps(fn)
        def handler(self: "ParameterServerService", request, context):
            start = time.perf_counter()
            table = ""
            try:
                with inflight.scope(self.budget, context):
                    request = _admitted(method, request, context)
                    if not hasattr(request, "__next__"):
                        table = getattr(request, "table", "")
                    response, table, rows, nbytes = fn(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                error = _status_of(method, exc)
            else:
                self.stats.record(table, method, time.perf_counter() - start, rows=rows,
                                  nbytes=nbytes)
                return response
            self.stats.record(table, method, time.perf_counter() - start, error=True,
                              code=error[0].name)
            context.abort(*error)
        return handler
    return decorate


def _rpc_many(method: str):
    """Wrap a multi-table handler returning (response, {table: PartCounts})."""
    def decorate(fn):
        @functools.wraps(fn)
        def handler(self: "ParameterServerService", request, context):
            start = getattr(context, "started", None) or time.perf_counter()  # (parked:
            try:                                                    # since its first try)
                with inflight.scope(self.budget, context):
                    request = _admitted(method, request, context)
                    response, per_table = fn(self, request, context)
            except waits.WouldWait:  # (the data plane's loop parks it, or hands it on)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                error = _status_of(method, exc)
            else:
                self.stats.record_many(method, time.perf_counter() - start, per_table)
                return response
            self.stats.record_many(method, time.perf_counter() - start, {}, error=True,
                                   code=error[0].name)
            context.abort(*error)
        return handler
    return decorate


def _history(shard: TableShard, request: ps_pb2.ShardRows):
    """The (uses, last_used) an ImportRows page carries, or None; refused when it carries
    only one of them."""
    present = [request.HasField(f) for f in ("uses", "last_used")]
    if not any(present):
        return None
    if not all(present):
        raise invalid(f"{shard.label}: ImportRows carries "
                      f"{'uses' if present[0] else 'last_used'} without "
                      f"{'last_used' if present[0] else 'uses'}; send both or neither")
    return wire.decode(request.uses, "uses"), wire.decode(request.last_used, "last_used")


def _check_same_spec(existing: TableShard | None, spec: TableSpec) -> None:
    if existing is not None and existing.spec != spec:
        raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                           f"{existing.label} exists with a different spec "
                           f"({existing.spec.describe_difference(spec)}); delete it first "
                           f"or create it with the same spec")


def new_server_id() -> int:
    """A random nonzero 64-bit id, made once per server process (DataPlaneResponse.server_id,
    with or without a data plane, and its data plane's hello): a client tells a server
    started again on the same address from the one it talked to."""
    while True:
        found = secrets.randbits(64)
        if found:
            return found


class ParameterServerService(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, data_dir: Path | None, max_message_bytes: int,
                 memory_bytes: int = 0, wait_threads: int | None = None,
                 baseline_bytes: int = 0, restore_newest: bool = False,
                 restore_skip: frozenset[str] = frozenset()) -> None:
        """`baseline_bytes`: the process's resident memory before any table (`MemoryBudget`);
        `restore_newest` (--restore-newest): every shard created starts from the newest
        complete checkpoint of its table in `data_dir` (`_restore_newest`), but for those
        `restore_skip` names (--restore-newest-on-restart: `parallax_ps.instance`)."""
        self.data_dir = data_dir
        self.restore_newest = restore_newest
        self.restore_skip = restore_skip
        self.wait_threads = wait_threads  # threads for WAITING_METHODS; None: not checked
        self.max_message_bytes = max_message_bytes
        self.data_port = 0  # set by the server once its data plane listens
        self.server_id = new_server_id()  # this process's; its data plane's hello says it too
        self.save_owner = secrets.token_hex(8)  # names this server's claims in a save
        self.data_idle_timeout_s = 0
        self.memory_bytes = memory_bytes
        self.budget = MemoryBudget(memory_bytes, baseline_bytes)
        self.held_states = HeldStates(self.budget)  # held checkpoints' state pieces
        self.stats = ServerStats()
        self.barriers = Barriers()
        self._shards: dict[tuple[str, int], TableShard] = {}
        self._lock = threading.Lock()         # guards the dict
        self._create_lock = threading.Lock()  # serialises (slow) table creation

    # ---- registry ------------------------------------------------------------------------
    def shard(self, table: str, shard_index: int) -> TableShard:
        with self._lock:
            found = self._shards.get((table, shard_index))
            if found is None:
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"table {table!r} shard {shard_index} does not exist on this "
                                   f"server (it holds {self._held()}); create it first")
            return found

    def _held(self, shown: int = 8) -> str:
        """Some of the shards held, for a message (gRPC refuses status details over 8 KB:
        a server with thousands of tables must not turn NOT_FOUND into RESOURCE_EXHAUSTED)."""
        held = sorted(f"{t}[{i}]" for t, i in self._shards)
        if not held:
            return "no tables"
        more = f" and {len(held) - shown} more" if len(held) > shown else ""
        return ", ".join(held[:shown]) + more

    def selected(self, tables) -> list[TableShard]:
        """Shards of the named tables held here (all shards when no name is given); a server
        may hold no shard of a table, so the client checks that every table was found."""
        with self._lock:
            return [s for (t, _), s in sorted(self._shards.items()) if not tables or t in tables]

    def close(self) -> None:
        self.barriers.close()
        with self._lock:
            for shard in self._shards.values():
                shard.close("the server is shutting down; retry after it restarts")

    @contextlib.contextmanager
    def admitted(self, method: str, body_bytes: int, deadline: float):
        """The request scope of a data-plane frame whose body (`body_bytes`, not read yet)
        is held against --memory-mb first (`inflight.Scope.admit`): waits for room until
        `deadline`, or raises RequestError RESOURCE_EXHAUSTED."""
        with inflight.scope(self.budget) as scope:
            scope.admit(method, body_bytes, deadline, f"{method} of {body_bytes} bytes")
            yield scope

    # ---- tables ----------------------------------------------------------------------------
    @_rpc("CreateTable")
    def CreateTable(self, request, context):
        spec = TableSpec.from_proto(request.spec)
        key = (spec.name, request.shard_index)
        with self._create_lock:
            with self._lock:
                existing = self._shards.get(key)
                sibling = next((s for (t, _), s in self._shards.items() if t == spec.name), None)
            if existing is None:
                _check_same_spec(sibling, spec)  # one table, one spec on every shard
                self._check_wait_threads(spec)
                shard = TableShard(spec, request.shard_index, self.budget)
                if self.restore_newest:  # (before any request reaches it; answered to
                    shard.restored_from = self._restore_newest(shard)  # later creations too)
                with self._lock:
                    self._shards[key] = shard
                log.debug("created %s: %d rows x %d", shard.label, shard.storage.num_rows, spec.dim)
                return (ps_pb2.CreateTableResponse(created=True, rows=shard.storage.num_rows,
                                                   step=shard.steps.step,
                                                   restored_from=shard.restored_from),
                        spec.name, shard.storage.num_rows, 0)
        _check_same_spec(existing, spec)
        return (ps_pb2.CreateTableResponse(created=False, rows=existing.storage.num_rows,
                                           step=existing.steps.step,
                                           restored_from=existing.restored_from),
                spec.name, 0, 0)

    def _restore_newest(self, shard: TableShard) -> str:
        """Fill a new shard from the newest complete checkpoint of its table on disk, as a
        Restore of it would (rows, slots, step, dynamic state): this server replaces one
        that was lost, whose workers replay their pushes since that checkpoint's step.
        Returns the checkpoint's name (its directory's name, as ShardCheckpoint.checkpoint
        gives it: CreateTableResponse.restored_from). With none, the shard stays as created,
        fresh at step 0, and "" is returned, as on a server without the flag: a table first
        created after the server was started again (a reshard target) must be creatable,
        and a worker refuses itself to replay onto a shard that was not restored."""
        try:
            found = checkpoint.newest_holding(self.data_dir, shard.spec.name,
                                              self.restore_skip)
            if found is None:
                log.info("created %s fresh: no complete checkpoint of table %r under %s",
                         shard.label, shard.spec.name, self.data_dir)
                return ""
            directory, manifest = found
            ids, values, slots, step, state = checkpoint.load_for_shard(shard, directory,
                                                                        manifest)
            shard.restore(ids, values, slots, step, state, discard_pending=True)
        except BaseException:
            shard.close("its restore failed")  # (releases what it claimed of --memory-mb)
            raise
        log.info("created %s from checkpoint %s: %d rows at step %d", shard.label,
                 directory, len(ids), step)
        return directory.name

    def _check_wait_threads(self, spec: TableSpec) -> None:
        """Refuse a sync shard whose workers, with those of the sync shards held, could wait
        in more pulls at once than there are threads for waiting RPCs."""
        if self.wait_threads is None or spec.sync_mode != "sync":
            return
        with self._lock:
            held = [(t, s.spec.num_workers) for (t, _), s in self._shards.items()
                    if s.steps.sync]
        waiting = sum(workers for _, workers in held)
        if waiting + spec.num_workers <= self.wait_threads:
            return
        ours = sum(1 for t, _ in held if t == spec.name)
        needed = waiting + spec.num_workers * (spec.shard_count - ours)  # all of it here
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"table {spec.name!r}: this server has --threads {self.wait_threads} for waiting "
            f"requests, but its sync shards ({len(held) + 1} with this one) can have "
            f"{waiting + spec.num_workers} pulls waiting at once (each of a table's "
            f"{spec.num_workers} workers waits on each of its shards), and a pull with no "
            f"thread left would stall the job; restart the server with --threads {needed} or "
            f"more (parallax run --server-arg=--threads={needed}; that counts all "
            f"{spec.shard_count} shards of the table as placed here), or place fewer shards "
            f"on it")

    @_rpc("DeleteTable")
    def DeleteTable(self, request, context):
        shard = self.shard(request.table, request.shard_index)
        with self._lock:
            self._shards.pop((request.table, request.shard_index), None)
            if not any(table == request.table for table, _ in self._shards):
                self.stats.forget(request.table)  # (its last shard here)
        shard.close("the table was deleted")
        self._prune_held()  # (the pieces held with its marks)
        return ps_pb2.DeleteTableResponse(), request.table, 0, 0

    @_rpc("InitRows")
    def InitRows(self, request_iterator, context):
        stream = object()  # this stream's claim on the memory budget, while it buffers
        try:
            shard, ids, values = self._buffer_init_rows(request_iterator, stream)
            shard.assign(ids, values)  # the buffer is held until the rows are in place
        finally:
            self.budget.release(stream)
        return ps_pb2.InitRowsResponse(rows=len(ids)), shard.spec.name, len(ids), values.nbytes

    def _buffer_init_rows(self, request_iterator, stream: object):
        """An InitRows stream's chunks, checked and buffered under the budget's claim
        `stream` (streams open together are held to --memory-mb together); refused unless
        the stream ends after the chunk marked `last` (`_until_cancelled`)."""
        shard, ids_parts, value_parts, buffered, ended = None, [], [], 0, False
        for chunk in _until_cancelled(request_iterator):
            shard = self._init_rows_shard(chunk, shard, ended)
            ids = shard.check_ids(wire.decode(chunk.ids, "ids"))
            values = wire.decode(chunk.values, "values")
            shard.check_rows(values, len(ids), "values")
            buffered += ids.nbytes + values.nbytes
            self.budget.claim(stream, 2 * buffered, shard.label,  # and joined, at the end
                              f"an InitRows stream buffering {buffered} bytes of rows")
            ids_parts.append(ids)
            value_parts.append(values)
            ended = chunk.last
        if shard is None:
            raise invalid("InitRows stream was empty; send at least one chunk")
        if not ended:
            raise invalid(f"InitRows stream for {shard.label} ended without a chunk marked "
                          f"last, so none of its {sum(map(len, ids_parts))} rows were put in: "
                          f"the client cancelled it, or did not set InitRowsChunk.last=True "
                          f"on its final chunk (set it there)")
        ids = np.concatenate(ids_parts)
        unique, counts = np.unique(ids, return_counts=True)
        if len(unique) != len(ids):
            raise invalid(f"{shard.label}: InitRows sets id {unique[counts > 1][0]} more than "
                          f"once; send each id once")
        return shard, ids, np.concatenate(value_parts)

    def _init_rows_shard(self, chunk, shard: TableShard | None, ended: bool) -> TableShard:
        """The shard an InitRows stream's `chunk` is for: the first chunk's (`shard` None),
        which every later chunk must name; none may come after the one marked last."""
        _check_decoded(chunk)
        if shard is None:
            return self.shard(chunk.table, chunk.shard_index)
        if (chunk.table, chunk.shard_index) != (shard.spec.name, shard.shard_index):
            raise invalid(f"InitRows stream for {shard.label} carries a chunk for table "
                          f"{chunk.table!r} shard {chunk.shard_index}; one stream per shard")
        if ended:
            raise invalid(f"InitRows stream for {shard.label} carries a chunk after the one "
                          f"marked last; set InitRowsChunk.last on the final chunk only")
        return shard

    # ---- rows ------------------------------------------------------------------------------
    @_rpc("Pull")
    def Pull(self, request, context):
        """Answers with bytes the rows were gathered straight into (bulk_codec): one copy.
        The answer's size is checked before any wait and before it is allocated."""
        shard = self.shard(request.table, request.shard_index)
        ids = shard.check_ids(wire.decode(request.ids, "ids"))
        many.check_answer_size("Pull", [shard], [ids], self.max_message_bytes)
        deadline = _deadline(context)
        if request.min_step > shard.steps.step:  # wait before holding the answer's memory
            inflight.give_back_held()
            shard.wait_step(request.min_step, deadline)
        if shard.spec.hashed_keys and shard.vocab is None:
            with shard.cond:  # the table's own limit first: its refusal says more
                shard.check_capacity(ids)
        many.hold_answer("Pull", [shard], [ids], deadline)
        writer = None

        def allocate(rows: int, step: int) -> np.ndarray:
            nonlocal writer
            with many.exact_answer_size("Pull"):
                writer = bulk_codec.PullResponseWriter(
                    rows, shard.spec.dim, shard.answer_dtype(request.full_precision), step,
                    max_bytes=self.max_message_bytes)
            return writer.values

        values, _ = shard.pull(ids, request.min_step, deadline, allocate)
        return writer.data(), request.table, len(values), values.nbytes

    @_rpc("Push")
    def Push(self, request: bulk_codec.BulkPush, context):
        """`request` was decoded by bulk_codec: ids and grads are views of the received bytes."""
        if request.error:
            raise invalid(request.error)
        shard = self.shard(request.table, request.shard_index)
        grads = request.grads
        results, _ = many.push_many([shard], [request], _deadline(context))
        step, applied = results[0]
        return (ps_pb2.PushResponse(step=step, applied=applied), request.table, len(grads),
                grads.nbytes)

    @_rpc_many("PullMany")
    def PullMany(self, request, context):
        """Every part's rows, gathered straight into the answer's bytes (bulk_codec)."""
        shards = self._shards_of_parts(request.parts, "PullMany", context)
        return many.pull_many(shards, request, _deadline(context), self.max_message_bytes)

    @_rpc_many("PullMany")
    def PullManyPacked(self, request, context):
        """PullMany read and answered in packed_codec's layout (data plane only)."""
        shards = self._shards_of_parts(request.parts, "PullMany", context)
        return many.pull_many(shards, request, _deadline(context), self.max_message_bytes,
                              packed_codec.PullManyAnswerWriter)

    @_rpc("DataPlane")
    def DataPlane(self, request, context):
        """Where PullMany and PushMany are also served as frames (0: nowhere)."""
        return ps_pb2.DataPlaneResponse(port=self.data_port, version=dataplane.VERSION,
                                        server_id=self.server_id,
                                        max_message_bytes=self.max_message_bytes,
                                        idle_timeout_s=self.data_idle_timeout_s,
                                        packed=True), "", 0, 0

    @_rpc_many("PushMany")
    def PushMany(self, request: bulk_codec.BulkPushMany, context):
        """`request` was decoded by bulk_codec: every part's rows are views of the bytes."""
        if request.error:
            raise invalid(request.error)
        shards = self._shards_of_parts(request.parts, "PushMany", context)
        results, per_table = many.push_many(shards, request.parts, _deadline(context))
        response = ps_pb2.PushManyResponse()
        for step, applied in results:
            response.parts.add(step=step, applied=applied)
        return response, per_table

    PushManyPacked = PushMany  # the request was read by packed_codec: the same parts

    def _shards_of_parts(self, parts, method: str, context=None) -> list[TableShard]:
        """The shard of each part (those an earlier attempt of the same data-plane request
        found, `context.shards`); a request of more parts than a step can need (one per
        table shard held, give or take its chunks) is refused before any part's work."""
        if getattr(context, "shards", None) is not None:
            return context.shards
        if not parts:
            raise invalid(f"{method} carries no parts; send at least one")
        with self._lock:
            limit = MAX_PARTS_PER_SHARD * max(1, len(self._shards))
        if len(parts) > limit:
            raise invalid(f"{method} carries {len(parts)} parts, and this server takes at most "
                          f"{MAX_PARTS_PER_SHARD} per table shard it holds ({limit}): a step "
                          f"needs one part per table shard; send fewer, larger parts")
        shards = [self.shard(part.table, part.shard_index) for part in parts]
        if hasattr(context, "shards"):
            context.shards = shards
        return shards

    @_rpc("WaitStep")
    def WaitStep(self, request, context):
        shard = self.shard(request.table, request.shard_index)
        step, pushed = shard.wait_step(request.min_step, _deadline(context))
        return ps_pb2.StepResponse(step=step, pushed_workers=pushed), request.table, 0, 0

    @_rpc("Barrier")
    def Barrier(self, request, context):
        active = getattr(context, "is_active", None)
        if active is not None and hasattr(context, "add_callback"):
            context.add_callback(self.barriers.wake)  # (when the RPC ends: it may be cancelled)
        generation = self.barriers.wait(request.name, request.rank, request.count,
                                        _deadline(context),
                                        (lambda: not active()) if active else lambda: False)
        return ps_pb2.BarrierResponse(generation=generation), "", 0, 0

    # ---- live resharding ---------------------------------------------------------------------
    @_rpc("ExportRows")
    def ExportRows(self, request, context):
        shard = self.shard(request.table, request.shard_index)
        spec = shard.spec
        row_bytes = (1 + len(shard.optimizer.slot_names)) * spec.dim * \
            np.dtype(spec.dtype).itemsize + 8 + (16 if spec.dynamic else 0)
        fit = max(1, (self.max_message_bytes - 65536) // row_bytes)
        limit = min(request.max_rows, fit) if request.max_rows > 0 else fit
        ids, values, slots, step, total, history = shard.export(request.offset, limit,
                                                                request.changed_only)
        response = ps_pb2.ShardRows(table=spec.name, shard_index=shard.shard_index, step=step,
                                    next_offset=request.offset + len(ids), total_rows=total)
        wire.encode(ids, response.ids)
        wire.encode(values, response.values)
        for name, slot in slots.items():
            response.slot_names.append(name)
            wire.encode(slot, response.slots.add())
        if history is not None:
            wire.encode(history[0], response.uses)
            wire.encode(history[1], response.last_used)
        nbytes = values.nbytes + sum(s.nbytes for s in slots.values())
        return response, spec.name, len(ids), nbytes

    @_rpc("ImportRows")
    def ImportRows(self, request, context):
        shard = self.shard(request.table, request.shard_index)
        if len(request.slot_names) != len(request.slots):
            raise invalid(f"{shard.label}: ImportRows names {len(request.slot_names)} slots but "
                          f"carries {len(request.slots)} slot tensors; send one per name")
        if len(set(request.slot_names)) != len(request.slot_names):
            raise invalid(f"{shard.label}: ImportRows repeats a slot name "
                          f"({list(request.slot_names)})")
        ids = wire.decode(request.ids, "ids")
        values = wire.decode(request.values, "values")
        slots = {name: wire.decode(t, f"slot {name}")
                 for name, t in zip(request.slot_names, request.slots)}
        rows, step = shard.import_rows(ids, values, slots, request.step,
                                       request.restart_changes, _history(shard, request))
        return (ps_pb2.ImportRowsResponse(rows=rows, step=step), shard.spec.name, len(ids),
                values.nbytes)

    # ---- checkpoints -------------------------------------------------------------------------
    @_rpc("Save")
    def Save(self, request, context):
        if request.held:
            return self._save_held(request), "", 0, 0
        root = checkpoint.resolve(self.data_dir, request.path)
        shards = self.selected(request.tables) if request.phase == ps_pb2.SAVE_PREPARE else []
        response = ps_pb2.SaveResponse(shards=checkpoint.save(root, request, shards,
                                                             self.save_owner))
        return response, "", sum(s.rows for s in response.shards), 0

    @_rpc("Restore")
    def Restore(self, request, context):
        if request.held:
            return self._restore_held(request), "", 0, 0
        shards = self.selected(request.tables)
        if not shards:  # nothing to restore here, whatever this data directory holds
            return ps_pb2.RestoreResponse(), "", 0, 0
        directory, manifest = checkpoint.open_checkpoint(self.data_dir, request)
        loaded = [checkpoint.load_for_shard(shard, directory, manifest) for shard in shards]
        response = ps_pb2.RestoreResponse()
        with contextlib.ExitStack() as held:  # all shards of this server, or none
            for shard in shards:
                held.enter_context(shard.cond)
            for shard in shards:
                if not request.discard_pending:
                    shard.check_between_steps()
            shards[0].budget.check_together([(shard, *shard.restore_need(len(ids)))
                                             for shard, (ids, *_) in zip(shards, loaded)])
            for shard, (ids, values, slots, step, state) in zip(shards, loaded):
                if not request.verify_only:
                    shard.restore(ids, values, slots, step, state, request.discard_pending)
                response.shards.add(table=shard.spec.name, shard_index=shard.shard_index,
                                    rows=len(ids), step=step, checkpoint=directory.name,
                                    file=str(directory / shard.spec.name),
                                    sync=shard.spec.sync_mode == "sync")
        self._prune_held()  # (a restore drops the marks)
        return response, "", sum(s.rows for s in response.shards), 0

    # ---- held checkpoints (`held.py`) and their state pieces (`held_state.py`) -------------
    def _save_held(self, request) -> ps_pb2.SaveResponse:
        name = versions.checked_name(request.checkpoint)
        shards = self.selected(request.tables)
        if request.HasField("state"):
            if not shards:  # (nothing here would ever drop it: it has no mark to go with)
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"a state piece of held checkpoint {name!r} of tables "
                                   f"{sorted(request.tables)[:8]}, of which this server holds "
                                   f"no shard: send it to the servers that do "
                                   f"(PSClient.hold_state)")
            unmarked = [s.label for s in shards if not s.holds_mark(name)]
            if unmarked:
                raise RequestError(grpc.StatusCode.NOT_FOUND,
                                   f"a state piece of held checkpoint {name!r}, which "
                                   f"{unmarked[0]} does not hold: send it after the save's "
                                   f"PREPARE (PSClient.save)")
            self.held_states.add(request.path, name, [(s.spec.name, s.shard_index)
                                                      for s in shards],
                                 request.state, request.keep)
            return ps_pb2.SaveResponse()
        response = checkpoint.save_held(request, shards)
        if request.phase == ps_pb2.SAVE_ABORT:
            self.held_states.drop(name)
        self._prune_held()  # (PREPARE's or COMMIT's keep dropped marks: their pieces go)
        if request.phase == ps_pb2.SAVE_PREPARE:  # (the state pieces sent next fit it)
            response.max_message_bytes = self.max_message_bytes
        return response

    def _restore_held(self, request) -> ps_pb2.RestoreResponse:
        """Roll back to a held checkpoint, or verify it; a verification lists the state
        pieces kept of it (`checkpoint` empty: of every one under `path`; no shard verified
        then, nor while a piece is read)."""
        self._prune_held()
        shards = self.selected(request.tables)
        response = ps_pb2.RestoreResponse()
        if shards and not request.state_piece and (request.checkpoint or
                                                   not request.verify_only):
            response = checkpoint.restore_held(request, shards)
        if request.verify_only:
            for name, index, count, size, data in self.held_states.listing(
                    request.path, request.checkpoint, request.state_piece):
                response.states.add(checkpoint=name, index=index, count=count, bytes=size,
                                    data=data)
        else:
            self._prune_held()  # (a rollback drops the later marks)
        return response

    def _prune_held(self) -> None:
        """Drop the state pieces whose marks are gone."""
        def holds(name: str, keys: tuple) -> bool:
            with self._lock:
                shards = [self._shards.get(key) for key in keys]
            return all(s is not None and s.holds_mark(name) for s in shards)
        self.held_states.prune(holds)

    # ---- observability -----------------------------------------------------------------------
    @_rpc("Stats")
    def Stats(self, request, context):
        response = ps_pb2.StatsResponse(server_version=__version__,
                                        protocol_version=PROTOCOL_VERSION, pid=os.getpid(),
                                        max_message_bytes=self.max_message_bytes,
                                        memory_bytes=self.memory_bytes,
                                        methods=self.stats.server_methods())
        for shard in self.selected(request.tables):
            spec = shard.spec
            response.tables.add(
                table=spec.name, shard_index=shard.shard_index, shard_count=spec.shard_count,
                rows=shard.storage.num_rows, dim=spec.dim, dtype=wire.dtype_code(spec.dtype),
                bytes=shard.nbytes, step=shard.steps.step,
                pushed_workers=shard.steps.pushed_workers(),
                methods=self.stats.methods(spec.name),
                dynamic=shard.dynamic_stats())
        return response, "", 0, 0


def _on_pool(behavior, pool: futures.ThreadPoolExecutor):
    """`behavior`, run by gRPC on `pool` rather than the server's own executor (gRPC's
    `experimental_thread_pool` attribute of a method handler's behavior)."""
    def run(request, context):
        return behavior(request, context)
    run.experimental_thread_pool = pool
    return run


_SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
_BULK_REQUESTS = {"Push": bulk_codec.decode_push_request,
                  "PushMany": bulk_codec.decode_push_many_request}
# gRPC hands these methods' request bytes over undecoded (`Unread`): pulls, whose answers
# are large and whose ids are many (a push is admitted once decoded, its parts and the steps
# they buffer known: `many.push_need`)
ADMITTED_BEFORE_DECODING = ("Pull", "PullMany", "PullManyPacked")
_PACKED_REQUESTS = {"PullManyPacked": (packed_codec.decode_pull_many, "data-plane request"),
                    "PushManyPacked": (packed_codec.decode_push_many, "data-plane request")}


def request_deserializer(method: str):
    """How the server reads `method`'s request bytes (gRPC and the data plane alike): the
    bulk codec for Push and PushMany, packed_codec for the data plane's packed methods,
    protobuf otherwise; bytes that do not parse become an `Undecodable`, which the handler
    answers INVALID_ARGUMENT."""
    if method in _PACKED_REQUESTS:
        return _tolerant(*_PACKED_REQUESTS[method])
    name = _SERVICE.methods_by_name[method].input_type.name
    return _tolerant(_BULK_REQUESTS.get(method, getattr(ps_pb2, name).FromString), name)


def add_to_server(service: ParameterServerService, server: grpc.Server,
                  wait_pool: futures.ThreadPoolExecutor | None = None) -> None:
    """Register the service like the generated helper does, except that Pull and PullMany
    answers and Push and PushMany requests use the bulk codec (same wire format, fewer
    copies), and that `WAITING_METHODS` run on `wait_pool` when one is given."""
    handlers = {}
    for method in _SERVICE.methods:
        response_type = getattr(ps_pb2, method.output_type.name)
        serialize = response_type.SerializeToString
        if method.name in ("Pull", "PullMany"):
            serialize = bytes
        factory = (grpc.stream_unary_rpc_method_handler if method.client_streaming
                   else grpc.unary_unary_rpc_method_handler)
        behavior = getattr(service, method.name)
        if wait_pool is not None and method.name in WAITING_METHODS:
            behavior = _on_pool(behavior, wait_pool)
        parse = request_deserializer(method.name)
        if method.name in ADMITTED_BEFORE_DECODING:
            parse = functools.partial(Unread, parse=parse)
        handlers[method.name] = factory(behavior, request_deserializer=parse,
                                        response_serializer=serialize)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
