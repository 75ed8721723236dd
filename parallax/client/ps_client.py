"""The client of a set of parameter servers: create tables, place shards, checkpoints, stats."""
from __future__ import annotations

import functools
import logging
import secrets
from concurrent import futures
from typing import Sequence

import grpc

from parallax.client import held_state, replay
from parallax.client.connection import ClientOptions, ServerConnection
from parallax.client.replica_push import CopyConnection
from parallax.client.replicas import (Liveness, check_replicable, check_replicas, replica_sets,
                                      survives)
from parallax.client.row_mover import MoveReport, move_rows
from parallax.client.table import ShardedTable
from parallax.errors import ConfigError, ServerError
from parallax.protocol import checkpoint_names, server_identity
from parallax.protocol.specs import TableSpec
from parallax.ps.v1 import ps_pb2

log = logging.getLogger("parallax")
DEFAULT_KEEP = 3  # checkpoints kept under a path
# What a restore answers when the checkpoint it verified was removed before it was loaded.
_VANISHED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS)


def _unique_shards(replies) -> list:
    """The shards that `replies` name, each once (a copy's server may name one too)."""
    return list({(s.table, s.shard_index): s for reply in replies
                 for s in reply.shards}.values())


def _mixed_steps(shards) -> dict[str, list[int]]:
    """Sync tables whose shards are at different steps: {table: steps}."""
    steps: dict[str, set[int]] = {}
    for shard in shards:
        if shard.sync:
            steps.setdefault(shard.table, set()).add(shard.step)
    return {t: sorted(s) for t, s in sorted(steps.items()) if len(s) > 1}


class PSClient:
    """Connections to every server of a job; shard i of a table goes to server i % N unless a
    placement is given (with `options.replicas=2`, and a copy to the next server:
    `parallax.client.replicas`).

    Example:

        with PSClient(["127.0.0.1:7000", "127.0.0.1:7001"]) as client:
            table = client.create_table(TableSpec(name="emb", vocabulary_size=1_000_000,
                                                  dim=16, shard_count=2, optimizer=SGD(0.1)))
            rows = table.pull([3, 7, 3])                       # shape (3, 16)
            table.push([3, 7], np.ones((2, 16), np.float32), step=0)
    """

    def __init__(self, addresses: Sequence[str], options: ClientOptions | None = None) -> None:
        """Args:
            addresses: host:port of every server of the job, in the order tables' shards
                are placed on them (the same order on every worker).
            options: deadlines, retries, chunk size, TLS and token (default ClientOptions();
                `client_options_from_env` adds what `parallax run --secure` sets).

        Raises:
            ConfigError: no address. Nothing is contacted here: `wait_ready` checks that the
                servers answer, and every call raises ServerError naming the server.
        """
        if not addresses:
            raise ConfigError("PSClient needs at least one server address (host:port)")
        self.addresses = list(addresses)
        self.options = options = options or ClientOptions()
        self.servers = [ServerConnection(a, options) for a in self.addresses]
        check_replicas(options.replicas, len(self.servers))
        self.liveness = Liveness()
        holders = [CopyConnection(s, self.liveness, self._survives) for s in self.servers] \
            if options.replicas > 1 else []
        self._timeline = replay.Timeline()  # (replay_mb > 0: shared by its connections)
        self._routes = replica_sets(self.servers, options.replicas, self.liveness, holders) \
            if not options.replay_mb else replay.replayed(self.servers, options.replay_mb,
                                                          self._timeline)
        self.session = secrets.randbits(63) + 1  # this client's identity in async pushes
        self._newest = ""  # the newest checkpoint it saved or restored: its next save's name
        #                    sorts after it, whatever this host's clock says (new_name)
        self._holders: held_state.Holders | None = None  # of the last held save (hold_state)

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for route in self._replayed():
            route.stop_watching()
        for server in self.servers:
            server.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until every server reports SERVING; the error names the one that does not.
        With replicated shards, a server that does not within `timeout` (one that died before
        this client's first call) is lost instead, while every shard keeps a live copy."""
        for server in self.live_servers():
            try:
                server.wait_healthy(timeout)
            except ServerError as err:
                if not self._lost(server, err):
                    raise

    def live_servers(self) -> list[ServerConnection]:
        """Every server but those lost (only replicated shards outlive a server)."""
        return [s for s in self.servers if self.liveness.alive(s.address)]

    def _placement(self, spec: TableSpec, placement: Sequence[int] | None) -> list[int]:
        placement = list(placement) if placement is not None else \
            [i % len(self.servers) for i in range(spec.shard_count)]
        if len(placement) != spec.shard_count or not all(0 <= p < len(self.servers)
                                                         for p in placement):
            raise ConfigError(f"table {spec.name!r}: placement {placement} must give a server "
                              f"index in [0, {len(self.servers)}) for each of its "
                              f"{spec.shard_count} shards")
        return placement

    def table(self, spec: TableSpec, placement: Sequence[int] | None = None) -> ShardedTable:
        """A handle on an existing table (no RPC)."""
        if self.options.replicas > 1:
            check_replicable(spec)
        if self.options.replay_mb:
            replay.check_replayable(spec)
        return ShardedTable(spec, [self._routes[p] for p in self._placement(spec, placement)],
                            self.session)

    def create_table(self, spec: TableSpec, placement: Sequence[int] | None = None) -> ShardedTable:
        """Create every shard (idempotent: identical re-creation is a no-op)."""
        table = self.table(spec, placement)
        proto = spec.to_proto()
        calls = []
        for shard, conn in enumerate(table.shards):
            request = ps_pb2.CreateTableRequest(spec=proto, shard_index=shard)
            calls.append((conn, conn.future("CreateTable", request), request))
        for conn, future, request in calls:
            conn.result(future, "CreateTable", request, spec.name)
        for conn in self._replayed():
            conn.note_identity()
        return table

    def reshard(self, table: ShardedTable, name: str, shard_count: int,
                placement: Sequence[int] | None = None,
                max_rows_per_shard: int | None = None) -> tuple[ShardedTable, MoveReport]:
        """A new table `name` holding `table`'s rows, slots and step in `shard_count` shards
        (on `placement`; a bounded keyed table's bound: `TableSpec.resharded`). Call between
        steps; the old table is left for the caller to delete once no worker routes to it.
        On failure the new table is deleted again."""
        spec = table.spec.resharded(name, shard_count, max_rows_per_shard)
        target = self.create_table(spec, placement)
        try:
            if target.wait_step(0):
                raise ConfigError(f"cannot reshard {table.name!r} into {name!r}: a table of "
                                  f"that name already exists and has trained; pick a new name")
            return target, move_rows(table, target)
        except BaseException:
            self.delete_table(target)
            raise

    def delete_table(self, table: ShardedTable) -> None:
        for shard, conn in enumerate(table.shards):
            conn.call("DeleteTable", ps_pb2.DeleteTableRequest(table=table.name,
                                                               shard_index=shard), table.name)

    def delete_tables(self, prefix: str) -> list[str]:
        """Delete every shard of every table whose name starts with `prefix`, on every
        server (a restarted job's fresh start); the names deleted."""
        names = set()
        for server, reply in self._answers("Stats", ps_pb2.StatsRequest()):
            for shard in reply.tables:
                if shard.table.startswith(prefix):
                    server.call("DeleteTable", ps_pb2.DeleteTableRequest(
                        table=shard.table, shard_index=shard.shard_index), shard.table)
                    names.add(shard.table)
        return sorted(names)

    def _each(self, method: str, request) -> list:
        """The replies of `_answers`."""
        return [reply for _, reply in self._answers(method, request)]

    def _answers(self, method: str, request) -> list[tuple[ServerConnection, object]]:
        """Call every live server at once; once all have answered, (server, reply) of each,
        or the first error (no call is still running when this raises)."""
        calls = [(server, server.future(method, request)) for server in self.live_servers()]
        futures.wait([f for _, f in calls])
        answers = []
        for server, future in calls:
            try:
                answers.append((server, server.result(future, method, request)))
            except ServerError as err:
                if not self._lost(server, err):
                    raise
        return answers

    def _lost(self, server: ServerConnection, err: ServerError) -> bool:
        """Replicated shards: whether `err` lost `server` (left out from now on), which the
        job survives while every shard has a live copy; else the error stands."""
        return self.options.replicas > 1 and self.liveness.loses(server.address, err) and \
            self._survives()

    def _survives(self) -> bool:
        """Whether every shard still has a live copy."""
        lost = {i for i, s in enumerate(self.servers) if not self.liveness.alive(s.address)}
        return survives(lost, len(self.servers), self.options.replicas)

    def _held_shards(self, tables: Sequence[str]) -> set[tuple[str, int]] | None:
        """Replicated shards: (table, shard index) of every shard of `tables` (all: every
        table) the live servers hold, which a save must write; None without copies."""
        if self.options.replicas == 1:
            return None
        return {(shard.table, shard.shard_index) for _, reply in
                self._answers("Stats", ps_pb2.StatsRequest(tables=list(tables)))
                for shard in reply.tables}

    def _shards_of(self, replies, tables: Sequence[str], verb: str) -> list:
        shards = _unique_shards(replies)
        missing = set(tables) - {s.table for s in shards}
        if missing:
            raise ConfigError(f"cannot {verb} tables {sorted(missing)}: no server of "
                              f"{self.addresses} holds them; create them first")
        return shards

    def save(self, path: str, tables: Sequence[str] = (),
             keep: int = DEFAULT_KEEP, held: bool = False) -> list[ps_pb2.ShardCheckpoint]:
        """Every server writes its shards into a new checkpoint under `path` (in its data
        directory); it becomes the newest only once every server has written, checked,
        sealed and committed it, and only then are checkpoints beyond the newest `keep`
        removed. A failed or refused save leaves the earlier checkpoints as they were. Call
        between steps (after table.wait_step(k), before any push of step k): a sync table
        caught mid-step is refused. With replicated shards, a server lost during the save
        (every shard keeping a live copy) makes it start again, without that server: its
        copies are then written by the servers holding the others.

        `held=True`: the servers keep it in memory instead (servers/parallax_ps/held.py):
        instant, then each row's first write after it copies that row aside; restore it with
        `restore(path, tables, name, held=True)` while the servers run. Fixed-vocabulary sync
        tables only; `keep` bounds the held ones apart from those on disk. One request per
        server, all at once (`_save_held`)."""
        if keep < 1:
            raise ConfigError(f"keep={keep}: keep at least 1 checkpoint")
        renamed, rebuilds = False, 0
        while True:
            lost = self.liveness.lost
            try:
                for route in self._replayed():  # (rebuilt by a watch: the others' pushes)
                    if route.unreplayed:
                        self._caught_up(route)
                shards = self._seen(self._save_held(path, tables, keep) if held else
                                    self._save(path, tables, keep))
                self._timeline_saved(shards, held)
                return shards
            except ServerError as err:
                newer = checkpoint_names.newer_named(str(err))
                if newer and not renamed:  # (named on a clock ahead of this host's)
                    log.warning("checkpoint %r: the servers hold %s, newer than this host's "
                                "clock; saving again under a name after it", path, newer)
                    self._newest, renamed = max(self._newest, newer), True
                    continue
                if self._rebuilt(err, rebuilds):
                    rebuilds += 1
                    continue
                if self.liveness.lost == lost or not self._survives():
                    raise
                log.warning("checkpoint %r: a server was lost while it was written (%s); "
                            "writing it again from the copies left", path, err)

    def _replayed(self) -> list:
        """The `ReplayedConnection` of each server (replay_mb > 0), else none."""
        return self._routes if self.options.replay_mb else []

    def _timeline_saved(self, shards: list, held: bool) -> None:
        """Replayed servers: the checkpoint a save made may be restored by a replacement;
        a save on disk holds every table's rows written before it."""
        if not self._replayed():
            return
        self._timeline.saved(s.checkpoint for s in shards)
        for conn in self._replayed() if not held else ():
            conn.written.clear()

    def _rebuilt(self, err: ServerError, rebuilds: int) -> bool:
        """Replayed servers: whether `err` met a server lost and started again, now rebuilt
        with the steps this worker pushed (`ReplayedConnection.recover`, `wait_replayed`),
        so that a save may be made again (at most MAX_SAVE_REBUILDS times a save)."""
        if not self.options.replay_mb or rebuilds >= replay.MAX_SAVE_REBUILDS or \
                isinstance(err, replay.ReplayError):
            return False
        route = next((r for r in self._routes if r.address == err.address), None)
        if route is None or not route.lost(err):
            return False
        # (rebuilt now, or already by its `_Watch`, or the same server again)
        self._caught_up(route, lambda: route.recover(err, replay.SAVE_WAIT_S))
        return True

    def _caught_up(self, route, rebuild=None) -> None:
        """Replayed servers: `rebuild()` if given, then wait until the other workers' pushes
        are applied on `route`'s rebuilt shards (bounded), so that a save does not write
        them behind the job's step; ReplayError when they do not come."""
        try:
            if rebuild is not None:
                rebuild()
            route.wait_replayed(replay.SAVE_WAIT_S)
        except ServerError as late:
            if late.code not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                 grpc.StatusCode.FAILED_PRECONDITION):
                raise
            raise replay.ReplayError(
                f"checkpoint: server {route.address} was started again, and the other workers "
                f"did not send it their pushes within {replay.SAVE_WAIT_S:.0f}s (one without a "
                f"data plane finds the loss only at its next request there, and may be "
                f"waiting for this worker in a collective): the save fails rather than write "
                f"its shards behind the others ({late})", address=route.address, table=None,
                code=grpc.StatusCode.UNAVAILABLE) from None

    def _seen(self, shards: list) -> list:
        """`shards` (a save's or restore's answer), the newest checkpoint name noted."""
        self._newest = max([self._newest, *(s.checkpoint for s in shards)])
        return shards

    def _save(self, path: str, tables: Sequence[str], keep: int
              ) -> list[ps_pb2.ShardCheckpoint]:
        """A save on disk: PREPARE (write), COMMIT keep=0 (seal) and COMMIT keep (mark
        complete, prune), the commits one server after another (they may share a data
        directory); a checkpoint is complete only once every server has sealed it."""
        request = functools.partial(ps_pb2.SaveRequest, path=path, tables=list(tables),
                                    checkpoint=checkpoint_names.new_name(after=self._newest))
        lost = self.liveness.lost
        try:
            held = self._held_shards(tables)
            replies = self._each("Save", request(phase=ps_pb2.SAVE_PREPARE))
            # first: shards a server lost as it wrote them start the save again, even when
            # they were all of a table's (else refused below as a table no server holds)
            self._check_all_written(held, _unique_shards(replies), lost)
            self._check_none_started_again(tables, _unique_shards(replies))
            shards = self._shards_of(replies, tables, "save")
            self._check_one_step(path, replies)
            self._in_turn("Save", request(phase=ps_pb2.SAVE_COMMIT, keep=0))
        except BaseException:
            self._abort(request(phase=ps_pb2.SAVE_ABORT))
            raise
        self._in_turn("Save", request(phase=ps_pb2.SAVE_COMMIT, keep=keep))  # complete, prune
        return shards

    def _save_held(self, path: str, tables: Sequence[str], keep: int
                   ) -> list[ps_pb2.ShardCheckpoint]:
        """A held save in one round: every server at once marks its shards and drops their
        marks past the newest `keep` (PREPARE with keep). No commit round: a mark is used
        only where every server holds it (`holds`, a held restore), so a mark that a save
        failing elsewhere leaves is never used (and its ABORT drops it); a failed save
        leaves the newest `keep` - 1 before it. With replicated shards, a server lost in
        the round leaves no shard unmarked (each server marks the copies it keeps too).
        The answers name the servers holding the tables and their message limits: where
        this checkpoint's state goes (`hold_state`), with no round to ask them."""
        name = checkpoint_names.new_name(after=self._newest)
        request = functools.partial(ps_pb2.SaveRequest, path=path, tables=list(tables),
                                    checkpoint=name, held=True)
        try:
            answers = self._answers("Save", request(phase=ps_pb2.SAVE_PREPARE, keep=keep))
            replies = [reply for _, reply in answers]
            self._check_none_started_again(tables, _unique_shards(replies))
            shards = self._shards_of(replies, tables, "save")
            self._check_one_step(path, replies)
        except BaseException:
            self._abort(request(phase=ps_pb2.SAVE_ABORT))
            raise
        position = self._positions()
        self._holders = held_state.holders_of(
            name, tables, ((position[server.address], reply.max_message_bytes,
                            bool(reply.shards)) for server, reply in answers),
            self.options.max_message_bytes)
        return shards

    @staticmethod
    def _check_one_step(path: str, replies) -> None:
        """Refuse a checkpoint whose sync tables' shards (copies too) are at mixed steps."""
        mixed = _mixed_steps([s for reply in replies for s in reply.shards])
        if mixed:
            raise ConfigError(f"checkpoint {path!r} caught sync tables mid-step (shard "
                              f"steps {mixed}); save between steps, after "
                              f"table.wait_step(k) and before any push of step k")

    def _check_all_written(self, held: set | None, shards: list, lost: frozenset) -> None:
        """Replicated shards: raise unless every shard `held` was written (a server lost
        while it wrote leaves its part out: UNAVAILABLE, and the save starts again)."""
        missing = sorted(held - {(s.table, s.shard_index) for s in shards}) if held else []
        if not missing:
            return
        gone = sorted(self.liveness.lost - lost)
        raise ServerError(f"checkpoint: server(s) {gone} lost while it was written; shards "
                          f"{missing} not written", address=",".join(gone) or self.addresses[0],
                          table=None, code=grpc.StatusCode.UNAVAILABLE if gone else
                          grpc.StatusCode.DATA_LOSS)

    def _check_none_started_again(self, tables: Sequence[str], shards: list) -> None:
        """Replayed servers: raise NOT_FOUND, naming the server, when a shard this client
        created was not written (its server was started again and holds it no more), rather
        than commit a checkpoint without it: the save then waits for the shards' rebuild
        and starts again (`_rebuilt`)."""
        if not self.options.replay_mb:
            return
        written = {(s.table, s.shard_index) for s in shards}
        for route in self._routes:
            missing = sorted(k for k in route.created
                             if (not tables or k[0] in tables) and k not in written)
            if missing:
                table, shard = missing[0]
                raise ServerError(f"checkpoint: server {route.address} holds no shard {shard} "
                                  f"of table {table!r} (started again since it was created)",
                                  address=route.address, table=table,
                                  code=grpc.StatusCode.NOT_FOUND)

    def _in_turn(self, method: str, request) -> None:
        """Call every server, one after another (servers may share a data directory)."""
        for server in self.live_servers():
            try:
                server.call(method, request)
            except ServerError as err:
                self._lost(server, err)  # (a save then starts again without it)
                raise

    def _abort(self, request) -> None:
        """Best effort: a server that cannot be reached now drops the staging at a later
        save; servers that committed keep the checkpoint, never marked complete."""
        for server in self.live_servers():
            try:  # (no retries on a server gone: it drops the staging at a later save)
                server.call("Save", request, gone=lambda s=server: not s.healthy(1.0))
            except Exception as exc:  # noqa: BLE001 - the save's own error is the one raised
                if checkpoint_names.NO_DATA_DIR in str(exc) or \
                        server_identity.replaced(str(exc)):
                    continue  # it cannot save at all (or is a replacement): nothing staged
                log.warning("could not abort checkpoint %s on %s: %s", request.checkpoint,
                            server.address, exc)

    def restore(self, path: str, tables: Sequence[str] = (), checkpoint: str = "",
                held: bool = False, discard_pending: bool = False
                ) -> list[ps_pb2.ShardCheckpoint]:
        """Every server reloads its shards (any saved shard count) from the newest checkpoint
        under `path` (or `checkpoint`, or `path` naming one). Every server first verifies it,
        and all must hold the same one: a checkpoint any server cannot read changes none.
        The newest is the newest every server completed; one removed by a concurrent save
        between the verification and the load is restored again from the then newest.
        `held=True`: held checkpoint `checkpoint` (`save(held=True)`), rolled back to on
        every server once every server has verified it holds it; the pushes of the open
        step are dropped. `discard_pending`: so are those of a disk checkpoint's restore (a
        new attempt's, whose tables the workers of the attempt before left mid-step)."""
        shards = self._restored(path, tables, checkpoint, held, discard_pending)
        if self._replayed():
            self._timeline.restored(s.checkpoint for s in shards)
        for conn in self._replayed():  # (pushes kept before it are of abandoned steps)
            conn.forget()
        return shards

    def _restored(self, path: str, tables: Sequence[str], checkpoint: str, held: bool,
                  discard_pending: bool) -> list[ps_pb2.ShardCheckpoint]:
        if held:
            return self._seen(self._restore_held(tables, checkpoint))
        try:
            return self._seen(self._restore(path, tables, checkpoint, discard_pending))
        except ServerError as err:
            if checkpoint or err.code not in _VANISHED:
                raise
            log.warning("restoring %r again from its newest checkpoint: %s (a concurrent "
                        "save with keep= may have removed the one verified)", path, err)
            return self._seen(self._restore(path, tables, checkpoint, discard_pending))

    def _restore(self, path: str, tables: Sequence[str], checkpoint: str,
                 discard_pending: bool = False) -> list:
        request = functools.partial(ps_pb2.RestoreRequest, path=path, tables=list(tables),
                                    discard_pending=discard_pending)
        answers = self._answers("Restore", request(checkpoint=checkpoint, verify_only=True))
        self._shards_of([reply for _, reply in answers], tables, "restore")
        held = self._held(answers)
        names = sorted({n for found in held.values() for n in found})
        name = names[0] if names else ""
        if len(names) > 1:
            name = self._newest_everywhere(request, names)
            log.warning("the servers' newest complete checkpoints under %r differ (%s: a save "
                        "failed midway); restoring %s, the newest every server holds", path,
                        held, name)
        return self._shards_of(self._each("Restore", request(checkpoint=name)), tables,
                               "restore")

    def drop_held(self, tables: Sequence[str], checkpoint: str) -> None:
        """Every server drops held checkpoint `checkpoint` of `tables` (and its copies)."""
        self._each("Save", ps_pb2.SaveRequest(tables=list(tables), checkpoint=checkpoint,
                                              held=True, phase=ps_pb2.SAVE_ABORT))

    def holds(self, tables: Sequence[str], checkpoint: str) -> bool:
        """Whether every server holds held checkpoint `checkpoint` of `tables` (changes
        nothing): False when a server has no such mark or no shard of a table."""
        request = ps_pb2.RestoreRequest(tables=list(tables), checkpoint=checkpoint, held=True,
                                        verify_only=True)
        try:
            self._shards_of(self._each("Restore", request), tables, "restore")
        except ConfigError:
            return False  # a table none holds (dropped, or the servers started anew)
        except ServerError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                raise
            return False
        return True

    def hold_state(self, path: str, tables: Sequence[str], checkpoint: str, state: bytes,
                   keep: int = DEFAULT_KEEP) -> None:
        """Keep `state` (bytes) on the servers with held checkpoint `checkpoint` of
        `tables`, which `save(path, tables, held=True)` made: split over the servers that
        hold the tables' shards, a piece on each (and on the next with replicated shards:
        `held_state`), dropped with the mark; the pieces of the newest `keep` held
        checkpoints under `path` are kept. Raises ServerError RESOURCE_EXHAUSTED where a
        server's --memory-mb has no room (the pieces sent stay until their mark goes).
        One request per piece, all at once, to the servers this client's held save of
        `checkpoint` found holding the tables (else asked first, with a Stats round)."""
        holders = self._holders
        if holders is None or not holders.serves(checkpoint, tables):
            holders = self._state_holders(checkpoint, tables)
        marked, largest = list(holders.positions), holders.largest
        request = functools.partial(ps_pb2.SaveRequest, path=path, tables=list(tables),
                                    checkpoint=checkpoint, held=True, phase=ps_pb2.SAVE_COMMIT,
                                    keep=keep)
        overhead = request(state=ps_pb2.StatePiece(checkpoint=checkpoint)).ByteSize()
        pieces = held_state.split(state, len(marked), held_state.piece_limit(
            self.options.chunk_bytes, largest, overhead))
        calls = []
        for index, data in enumerate(pieces):
            piece = request(state=ps_pb2.StatePiece(checkpoint=checkpoint, index=index,
                                                    count=len(pieces), data=data))
            for position in held_state.holders(index, marked, self.options.replicas):
                server = self.servers[position]
                calls.append((server, piece, server.future("Save", piece)))
        futures.wait([future for *_, future in calls])
        for server, piece, future in calls:
            try:
                server.result(future, "Save", piece)
            except ServerError as err:
                if not self._lost(server, err):
                    raise

    def _state_holders(self, checkpoint: str, tables: Sequence[str]) -> held_state.Holders:
        """The live servers holding a shard of `tables`, asked (a Stats round): a held
        checkpoint's state goes there only."""
        position = self._positions()
        holders = held_state.holders_of(
            checkpoint, tables, ((position[server.address], reply.max_message_bytes,
                                  bool(reply.tables)) for server, reply in self._answers(
                                      "Stats", ps_pb2.StatsRequest(tables=list(tables)))),
            self.options.max_message_bytes)
        if holders is None:
            raise ConfigError(f"cannot hold a state with tables {sorted(tables)}: no server "
                              f"of {self.addresses} holds them; create and save them first")
        return holders

    def _positions(self) -> dict[str, int]:
        """{server address: its position in `servers`}."""
        return {server.address: i for i, server in enumerate(self.servers)}

    def held_state(self, path: str, after: str = "") -> tuple[str, bytes] | None:
        """(name, state) of the newest held checkpoint under `path` whose state
        (`hold_state`) the live servers keep whole; None when none is, or when it is not
        newer than checkpoint `after` (then nothing is read). The caller checks that its
        tables' marks are held too (`holds`)."""
        listing = ps_pb2.RestoreRequest(path=path, held=True, verify_only=True)
        position = self._positions()
        newest = held_state.newest_complete(
            (position[server.address], held_state.Listed(p.checkpoint, p.index, p.count,
                                                         p.bytes))
            for server, reply in self._answers("Restore", listing) for p in reply.states)
        if newest is None or newest[0] <= after:
            return None
        name, where = newest
        calls = []
        for index, servers in sorted(where.items()):
            request = ps_pb2.RestoreRequest(path=path, held=True, verify_only=True,
                                            checkpoint=name, state_piece=index + 1)
            server = self.servers[servers[0]]
            calls.append((index, servers, request, server.future("Restore", request)))
        futures.wait([future for *_, future in calls])
        pieces = {index: data for index, servers, request, future in calls
                  if (data := self._state_piece(index, servers, request, future)) is not None}
        try:
            return name, held_state.joined(pieces, len(where), name)
        except ConfigError as err:  # a piece dropped since it was listed
            log.warning("%s (dropped since the servers listed it): no held state read", err)
            return None

    def _state_piece(self, index: int, servers: list[int], request, future) -> bytes | None:
        """Piece `index` of a held state, from the first of `servers` (positions) that
        answers with it whole (`future`: the call to the first, in flight); None if none
        does."""
        for k, position in enumerate(servers):
            server = self.servers[position]
            try:
                reply = server.result(future if k == 0 else None, "Restore", request)
            except ServerError as err:
                if not self._lost(server, err) or k == len(servers) - 1:
                    raise
                continue  # (its copy, on the next server)
            for piece in reply.states:
                if piece.index == index and len(piece.data) == piece.bytes > 0:
                    return piece.data
        return None

    def _restore_held(self, tables: Sequence[str], checkpoint: str) -> list:
        request = functools.partial(ps_pb2.RestoreRequest, tables=list(tables),
                                    checkpoint=checkpoint, held=True)
        self._shards_of(self._each("Restore", request(verify_only=True)), tables, "restore")
        return self._shards_of(self._each("Restore", request()), tables, "restore")

    def _held(self, replies) -> dict[str, list[str]]:
        """{server address: checkpoint names its reply names}."""
        return {server.address: sorted({s.checkpoint for s in reply.shards})
                for server, reply in replies if reply.shards}

    def _newest_everywhere(self, request, names: list[str]) -> str:
        """The newest of `names` that every server verifies. A save that failed in its first
        commit round left its checkpoint on some servers only (not there: NOT_FOUND), one
        that failed in the second left it on all, some of them having pruned older ones."""
        for name in reversed(names[1:]):
            try:
                self._each("Restore", request(checkpoint=name, verify_only=True))
                return name
            except ServerError as err:
                if err.code != grpc.StatusCode.NOT_FOUND:
                    raise
        self._each("Restore", request(checkpoint=names[0], verify_only=True))
        return names[0]

    def stats(self, tables: Sequence[str] = ()) -> dict[str, ps_pb2.StatsResponse]:
        replies = self._answers("Stats", ps_pb2.StatsRequest(tables=list(tables)))
        return {server.address: reply for server, reply in replies}

    def barrier(self, name: str, rank: int, count: int, timeout: float | None = None) -> int:
        """Wait until `count` ranks reach barrier `name` (held by the first server; with
        replicated shards, the first one not lost: ranks waiting on a server that dies meet
        again on the next)."""
        request = ps_pb2.BarrierRequest(name=name, rank=rank, count=count)
        while True:
            server = self.live_servers()[0]
            try:
                return server.call("Barrier", request, timeout=timeout).generation
            except ServerError as err:
                if not self._lost(server, err):
                    raise
