"""A held checkpoint's state over the servers: bytes split into pieces, put together again.

The workers' part of a held commit (the chief's dense variables and where the backup was
taken: `parallax.tf.state.held_backups`) goes to the servers beside the tables' marks
(`PSClient.hold_state`), so that a worker's death, disk included, cannot take it: split
evenly into at least one piece per server holding the tables' shards, of at most
`piece_bytes` each (a message limit's worth: a large dense model makes more pieces, never a
larger message), piece i on the i-th of those servers (mod their count) and, with replicated
shards, also on the next, so that one server's death keeps every piece as it keeps every
shard. A server holding no shard of the tables gets no piece (it has no mark to drop it
with). No server holds the whole state with two such servers or more (three or more with
replicated shards: with two, each keeps every piece).
Reading it back (`PSClient.held_state`) is all or nothing: a checkpoint that misses a piece
on every live server is not held.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from parallax.errors import ConfigError

STATE_MARGIN_BYTES = 1 << 10  # a piece's message: its data, its fields, and protobuf's tags


@dataclass(frozen=True)
class Holders:
    """The servers holding a held checkpoint's tables, as its save's PREPARE answers named
    them: where its state goes (`PSClient.hold_state`) without a Stats round to ask."""
    checkpoint: str
    tables: tuple[str, ...]  # sorted
    positions: tuple[int, ...]  # of the servers whose answer named a shard, in order
    largest: int  # the largest message every one of them takes, in bytes

    def serves(self, checkpoint: str, tables) -> bool:
        """Whether these are the holders of `checkpoint` of `tables`."""
        return checkpoint == self.checkpoint and tuple(sorted(tables)) == self.tables


def holders_of(checkpoint: str, tables, answers: Iterable[tuple[int, int, bool]],
               default_largest: int) -> Holders | None:
    """The Holders of `answers`: (server position, the largest message it takes, 0 when it
    does not say; whether it holds a shard of `tables`) of every live server; None when none
    holds one. `default_largest`: the client's own limit, where no holder says."""
    holding = sorted((position, size) for position, size, holds in answers if holds)
    if not holding:
        return None
    largest = min((size for _, size in holding if size > 0), default=default_largest)
    return Holders(checkpoint, tuple(sorted(tables)), tuple(p for p, _ in holding), largest)


@dataclass(frozen=True)
class Listed:
    """A piece a server lists: which checkpoint, which piece of how many, its size."""
    checkpoint: str
    index: int
    count: int
    size: int


def split(state: bytes, servers: int, piece_bytes: int) -> list[bytes]:
    """`state` in pieces of equal size (the last one shorter), at least `servers` of them
    and none over `piece_bytes`."""
    if not state:
        raise ConfigError("a held checkpoint's state is empty: send its bytes, or none")
    if piece_bytes < 1:
        raise ConfigError(f"piece_bytes={piece_bytes}: state pieces need at least 1 byte "
                          f"(ClientOptions.chunk_mb)")
    count = max(servers, -(-len(state) // piece_bytes))
    size = -(-len(state) // count)
    return [state[i * size:(i + 1) * size] for i in range(count)]


def holders(index: int, marked: list[int], replicas: int) -> list[int]:
    """The servers (positions) that keep piece `index`, among those holding the tables'
    shards (`marked`, in order: a piece lives as long as their marks): its own, then its
    copy's with replicated shards."""
    return sorted({marked[(index + k) % len(marked)] for k in range(replicas)})


def piece_limit(chunk_bytes: int, max_message_bytes: int, overhead: int) -> int:
    """The most state bytes a piece may carry: the client's chunk, within the smallest
    message a receiving server takes less the request's own fields (`overhead`)."""
    return max(1, min(chunk_bytes, max_message_bytes) - overhead - STATE_MARGIN_BYTES)


def newest_complete(listed: Iterable[tuple[int, Listed]]
                    ) -> tuple[str, dict[int, list[int]]] | None:
    """The newest checkpoint whose pieces the live servers hold together, every one of them,
    as (name, {piece index: servers holding it}); None when none is whole. `listed`:
    (server position, piece) of what every live server lists."""
    found: dict[str, dict[int, list[int]]] = {}
    counts: dict[str, set[int]] = {}
    for server, piece in listed:
        found.setdefault(piece.checkpoint, {}).setdefault(piece.index, []).append(server)
        counts.setdefault(piece.checkpoint, set()).add(piece.count)
    for name in sorted(found, reverse=True):  # names sort by age (checkpoint_names)
        count = max(counts[name])
        if len(counts[name]) == 1 and sorted(found[name]) == list(range(count)):
            return name, found[name]
    return None


def joined(pieces: dict[int, bytes], count: int, name: str) -> bytes:
    """The state from its `count` pieces, each there once."""
    missing = sorted(set(range(count)) - set(pieces))
    if missing:
        raise ConfigError(f"held checkpoint {name}'s state misses pieces {missing} of {count}")
    return b"".join(pieces[i] for i in range(count))
