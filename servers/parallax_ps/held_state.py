"""The workers' state of held checkpoints: opaque pieces a server keeps beside its marks.

A held checkpoint (`held.py`) keeps the tables' part of a commit in the servers' memory; its
other part, the chief worker's dense variables and where the backup was taken, is sent after
it as bytes split into pieces over the servers holding the tables (`PSClient.hold_state`),
so that a worker's death, disk and all, cannot take it. Each server keeps its pieces by
checkpoint name under the save's path (a job's), the newest `keep` names per path, counted
against --memory-mb with the tables: a piece that would pass the limit is refused,
RESOURCE_EXHAUSTED. A piece lives as long as the mark it was sent with: dropped with it (an
ABORT, `keep`, a rollback past it, a restore from disk, a deleted table, copies dropped
under --memory-mb), which `prune` finds at the server's next Save, Restore or DeleteTable.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import grpc

from parallax_ps.budget import MemoryBudget
from parallax_ps.errors import RequestError, invalid

_MIB = 1 << 20


@dataclass
class _State:
    path: str
    name: str
    shards: tuple[tuple[str, int], ...]  # (table, index) of the marked shards it was sent to
    pieces: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # index: (count, data)

    @property
    def nbytes(self) -> int:
        return sum(len(data) for _, data in self.pieces.values())


class HeldStates:
    """The state pieces one server keeps, by checkpoint name."""

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._total()

    def add(self, path: str, name: str, shards: list[tuple[str, int]], piece,
            keep: int) -> None:
        """Keep `piece` (a StatePiece) of held checkpoint `name` of `shards` (the shards
        here marked `name`: (table, index)) under `path`, then only the newest `keep`
        checkpoints' pieces under `path`."""
        if piece.count < 1 or not 0 <= piece.index < piece.count:
            raise invalid(f"state piece {piece.index} of {piece.count} of held checkpoint "
                          f"{name!r}: send pieces 0..count-1 of count >= 1 (PSClient.save)")
        if keep < 1:
            raise invalid(f"state piece of held checkpoint {name!r} with keep={keep}: keep "
                          f"at least 1 checkpoint's pieces")
        if not piece.data or piece.checkpoint not in ("", name):
            raise invalid(f"state piece {piece.index} of held checkpoint {name!r}: "
                          f"{'no data' if not piece.data else f'it names {piece.checkpoint!r}'}"
                          f"; send a piece's bytes with the request's checkpoint "
                          f"(PSClient.hold_state)")
        with self._lock:
            state = self._states.get(name) or _State(path, name, tuple(sorted(shards)))
            counts = {count for count, _ in state.pieces.values()} - {piece.count}
            if counts:
                raise invalid(f"state piece {piece.index} of {piece.count} of held checkpoint "
                              f"{name!r}, whose pieces here count {sorted(counts)[0]}: send "
                              f"every piece of one state with the same count")
            old = state.pieces.get(piece.index, (0, b""))[1]
            total = self._total() - len(old) + len(piece.data)
            self._check_room(name, total, len(piece.data))
            state.pieces[piece.index] = (piece.count, piece.data)
            self._states[name] = state
            under = sorted(n for n, s in self._states.items() if s.path == path)
            for gone in under[:max(0, len(under) - keep)]:
                del self._states[gone]
            self._account()

    def drop(self, name: str) -> None:
        with self._lock:
            self._states.pop(name, None)
            self._account()

    def prune(self, holds: Callable[[str, tuple], bool]) -> None:
        """Drop the pieces of checkpoints whose mark is gone (`holds(name, shards)`:
        whether each of `shards`, (table, index), is still here and holds mark `name`)."""
        with self._lock:
            gone = [n for n, s in self._states.items() if not holds(n, s.shards)]
            for name in gone:
                del self._states[name]
            if gone:
                self._account()

    def listing(self, path: str, name: str, wanted: int) -> list[tuple]:
        """(name, index, count, size, data) of the pieces of `name` (every name under `path`
        when empty), with the data of piece `wanted` - 1 only (0: none)."""
        with self._lock:
            states = [s for n, s in sorted(self._states.items())
                      if (n == name if name else s.path == path)]
            return [(s.name, index, count, len(data),
                     data if wanted and index == wanted - 1 else b"")
                    for s in states for index, (count, data) in sorted(s.pieces.items())]

    def _check_room(self, name: str, total: int, size: int) -> None:
        if self._budget.may_hold(self, total):
            return
        limit = self._budget.limit
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"a state piece of {size / _MIB:.1f} MiB of held checkpoint {name!r} would bring "
            f"the held state this server keeps to {total / _MIB:.1f} MiB, which with its "
            f"tables passes its limit of {limit / _MIB:.1f} MiB (--memory-mb); raise "
            f"--memory-mb or add servers (the state is split over them)")

    def _total(self) -> int:
        """Bytes of every piece kept (call with the lock held)."""
        return sum(s.nbytes for s in self._states.values())

    def _account(self) -> None:
        self._budget.update(self, self._total())
