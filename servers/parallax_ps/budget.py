"""The memory the tables of one server may hold (`--memory-mb`), enforced before allocation.

Every shard holds a claim: its rows and optimizer slots (a fixed-vocabulary shard claims its
whole size when it is created, a keyed shard the rows it holds) plus the gradients of the
open sync step it buffers. A request that would take the total over the limit is refused with
RESOURCE_EXHAUSTED before anything is allocated or changed. A limit of 0 means no limit.

The same limit bounds the working memory of the requests in flight (`hold`, estimated by
`parallax_ps.inflight` from a request's size before it is read or its answer allocated),
together with the process's own baseline (`baseline`: the interpreter, numpy and gRPC,
resident before any table): a request is let in while the baseline, the tables and the
requests in flight leave room for it, else it
waits for room until its deadline; one that cannot fit beside the tables at all is refused
at once. Tables are checked against the tables alone (a table never fails for a burst of
requests), so tables plus requests stay within the limit plus the growth of the tables by
the requests in flight.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Sequence, Union

import grpc

from parallax_ps.errors import RequestError

_MIB = 1 << 20
MAX_WAIT_S = 1.0  # one wait for room at most (then the condition is checked again)
What = Union[str, Callable[[], str]]  # what is being held; a callable is formatted on refusal


def _mib(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f} MiB"


class MemoryBudget:
    def __init__(self, limit_bytes: int, baseline: int = 0) -> None:
        """`baseline`: the process's resident memory before any table; counted against the
        requests in flight when it is at most half the limit (a smaller limit is a test's,
        whose tables still need requests to reach them). It was a quarter: the baseline's
        file-backed pages vary with the page cache (61 MB here, 73 MB on a fresh install),
        so under --memory-mb 256 it was counted on one machine and not on the other, and a
        66 MB push the first refused from its frame's size the other read and decoded
        first (peak RSS 204 MB against 356 MB)."""
        self.limit = limit_bytes
        self.resident_baseline = baseline
        self.baseline = baseline if limit_bytes >= 2 * baseline else 0  # (counted)
        self._claims: dict[object, int] = {}
        self._total = 0
        self._held = 0  # working memory of the requests in flight (`hold`)
        self._floor_kept = False  # a waiting request holds its floor (`floor_turn`)
        self._uncounted = 0  # the bodies of the other waiting requests (`floor_turn`)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)

    def check(self, owner: object, nbytes: int, label: str, what: What) -> None:
        """Raise RESOURCE_EXHAUSTED unless `owner` may hold `nbytes` in all (changes nothing);
        owner None: a buffer held for one request, outside every claim."""
        with self._lock:
            self._refuse_over(owner, nbytes, label, what)

    def check_together(self, needs: Sequence[tuple[object, int, str, What]]) -> None:
        """`check` for several owners at once (the shards of one request, each with what it
        would hold in all): raise RESOURCE_EXHAUSTED, naming the first that grows, unless
        all of them fit together (changes nothing)."""
        with self._lock:
            wanted = {id(owner): (owner, nbytes) for owner, nbytes, _, _ in needs}
            total = self._total + sum(nbytes - self._claims.get(owner, 0)
                                      for owner, nbytes in wanted.values())
            if not self.limit or total <= self.limit:
                return
            for owner, nbytes, label, what in needs:
                if nbytes > self._claims.get(owner, 0):
                    self._refuse(total - nbytes, nbytes, label, what)
            self._refuse(total, 0, needs[0][2], needs[0][3])  # none grows: over already

    def claim(self, owner: object, nbytes: int, label: str, what: What) -> None:
        """Check, then record that `owner` holds `nbytes` in all."""
        with self._lock:
            self._refuse_over(owner, nbytes, label, what)
            self._set(owner, nbytes)

    def may_hold(self, owner: object, nbytes: int) -> bool:
        """Whether `owner` may hold `nbytes` in all beside the other claims (changes
        nothing)."""
        with self._lock:
            others = self._total - self._claims.get(owner, 0)
            return not self.limit or others + nbytes <= self.limit

    def update(self, owner: object, nbytes: int) -> None:
        """Record what `owner` holds now (after a checked change)."""
        with self._lock:
            self._set(owner, nbytes)

    def reserve_spare(self, owner: object, nbytes: int, spare: int) -> bool:
        """Record that `owner` holds `nbytes` plus `spare` bytes of spare capacity, if the
        spare is at most half the room left beside them (so spare capacity never takes the
        last of the limit from rows); False, and nothing recorded, otherwise."""
        with self._lock:
            others = self._total - self._claims.get(owner, 0)
            if self.limit and 2 * spare > self.limit - others - nbytes:
                return False
            self._set(owner, nbytes + spare)
            return True

    def release(self, owner: object) -> None:
        with self._lock:
            self._total -= self._claims.pop(owner, 0)
            self._room.notify_all()

    @property
    def held(self) -> int:
        """Bytes held by the requests in flight."""
        return self._held

    def accounted(self) -> int:
        """Resident bytes the budget explains: the baseline, the tables and the requests in
        flight."""
        return self.resident_baseline + self._total + self._held

    @contextlib.contextmanager
    def floor_turn(self, floor: int, held: int) -> Iterator[int]:
        """What a request about to wait for room keeps holding meanwhile, of the `held` bytes
        it holds: its `floor` (the body it received) if no other waiter keeps one now, else
        nothing (its body goes uncounted while it waits, as a gRPC request's does). With one
        floor kept at a time, the waiters' floors can never together hold the room each of
        them waits for. The bodies not kept still count against admissions
        (`hold(admitting=True)`), so new frames are not read into the memory they take (64
        concurrent pulls reached 1.45x --memory-mb without that)."""
        with self._lock:  # (a request holding none of its body, as a pull that waited for
            keep = min(held, floor)  # its step, takes no turn)
            mine = keep > 0 and not self._floor_kept
            keep = keep if mine else 0
            self._floor_kept = self._floor_kept or mine
            self._uncounted += floor - keep
        try:
            yield keep
        finally:
            with self._room:
                if mine:
                    self._floor_kept = False
                if floor - keep:
                    self._uncounted -= floor - keep
                    self._room.notify_all()  # (admissions wait for the uncounted bodies)

    def fits(self, nbytes: int) -> bool:
        """Whether a request holding nothing could hold `nbytes` beside the tables (once the
        other requests in flight have given theirs back)."""
        return not self.limit or self.baseline + self._total + nbytes <= self.limit

    def hold(self, nbytes: int, deadline: float, what: What, own: int = 0,
             admitting: bool = False) -> bool:
        """Take `nbytes` more of working memory for a request in flight that holds `own`
        already (give it back with `unhold`): at once when the tables and the requests in
        flight leave room, else once they do, until `deadline` (time.monotonic()); False,
        holding nothing more, when the deadline passes first; RESOURCE_EXHAUSTED at once
        when `own + nbytes` cannot fit beside the tables. `admitting`: a frame whose body is
        not read yet, which waits for the waiting requests' uncounted bodies too."""
        if not self.limit or nbytes <= 0:
            return True
        with self._room:
            while self.baseline + self._total + self._held + nbytes + \
                    (self._uncounted if admitting else 0) > self.limit:
                if not self.fits(own + nbytes):
                    self._refuse_request(own + nbytes, what, waited=False)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._room.wait(min(remaining, MAX_WAIT_S))  # (a far deadline overflows)
            self._held += nbytes
            return True

    def refuse_waited(self, nbytes: int, what: What) -> None:
        """RESOURCE_EXHAUSTED: a request that needs `nbytes` found no room by its deadline."""
        with self._lock:
            self._refuse_request(nbytes, what, waited=True)

    def unhold(self, nbytes: int) -> None:
        if not self.limit or nbytes <= 0:
            return
        with self._room:
            self._held -= nbytes
            self._room.notify_all()

    def _refuse_request(self, nbytes: int, what: What, waited: bool) -> None:
        what = what() if callable(what) else what
        room = max(self.limit - self.baseline - self._total, 0)
        why = (f"the requests in flight held {_mib(self._held)} of the {_mib(room)} left "
               f"for requests until its deadline" if waited else
               f"its baseline (interpreter, numpy, gRPC) takes {_mib(self.baseline)} and the "
               f"tables hold {_mib(self._total)}, leaving {_mib(room)} for requests")
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{what} needs {_mib(nbytes)} of working memory, but this server may use "
            f"{_mib(self.limit)} (--memory-mb) and {why}; send smaller requests "
            f"(ClientOptions.chunk_mb), fewer at once, or raise --memory-mb")

    def _set(self, owner: object, nbytes: int) -> None:
        if nbytes < self._claims.get(owner, 0):
            self._room.notify_all()  # (the lock is held) room for waiting requests
        self._total += nbytes - self._claims.get(owner, 0)
        self._claims[owner] = nbytes

    def _refuse_over(self, owner: object, nbytes: int, label: str, what: What) -> None:
        others = self._total - self._claims.get(owner, 0)
        if self.limit and others + nbytes > self.limit:
            self._refuse(others, nbytes, label, what)

    def _refuse(self, others: int, nbytes: int, label: str, what: What) -> None:
        what = what() if callable(what) else what
        raise RequestError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{label}: {what} needs {_mib(nbytes)}, but this server's tables may use "
            f"{_mib(self.limit)} (--memory-mb) and other tables hold {_mib(others)}; "
            f"raise --memory-mb, spread the table over more servers or shards, or "
            f"delete tables")
