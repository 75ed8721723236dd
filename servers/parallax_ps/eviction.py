"""Dynamic tables' shards (keyed tables with admission and eviction): admission, eviction
and their counters.

Every decision is made when an update is applied (a sync step once all its pushes are in, an
async push on arrival), under the shard's lock, from the update's keys alone. Pulls change
nothing: a key without a row is answered with its initializer value, exactly what a row
admitted for it would start with, so every worker's pull of one step sees the same values
whichever of them came first. Per applied update, in order:

1. keys without a row are sighted (`admission.Sketch`); those admitted get a row, the
   gradients of the others are dropped (counted);
2. with `ttl_steps`, rows last used `ttl_steps` or more steps before this one are evicted;
3. with `eviction`, rows are evicted to make room for the admitted keys within
   `max_rows_per_shard`: LRU by last-used step, LFU by use count, ties by key. Rows of the
   update and of buffered (not yet applied) pushes are never evicted; admitted keys that
   still do not fit (an update with more keys than the bound) are dropped, highest keys
   first. Without `eviction`, such an update is refused (RESOURCE_EXHAUSTED);
4. the update's rows are marked used at this step (one use per update).

An import (ImportRows, live resharding) that would pass `max_rows_per_shard` evicts by the
same policy among the incoming and the held rows, by their use history (`import_room`);
without `eviction` it is refused whole.

An evicted row loses its value and optimizer slots; a key admitted again starts from its
initial value. Everything an update changed is kept in a `Change`, so a multi-part request
can take it back exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import grpc
import numpy as np

from parallax.protocol.specs import TableSpec
from parallax_ps.admission import Sketch, needs_sketch
from parallax_ps.errors import RequestError


@dataclass
class Counters:
    """A shard's admission and eviction counts since it was made (or restored)."""

    admitted: int = 0
    evicted_capacity: int = 0
    evicted_ttl: int = 0
    dropped_gradients: int = 0
    default_rows: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class Change:
    """What one update changed, for `Vocabulary.undo`."""

    admitted: np.ndarray
    evicted: tuple  # (keys, values, slots, last_used, uses) of the evicted rows
    used: tuple  # (keys, last_used, uses) before, of the rows the update used
    sighted: np.ndarray
    counters: Counters = field(default_factory=Counters)


def eviction_order(policy: str, keys: np.ndarray, last_used: np.ndarray,
                   uses: np.ndarray) -> np.ndarray:
    """Positions of candidate rows, first to evict first: LRU by last-used step, LFU by use
    count, ties by key."""
    return np.lexsort((keys, last_used if policy == "lru" else uses))


class Vocabulary:
    """The admission and eviction state of one dynamic table shard (its `KeyedRows` holds the
    per-row last-used steps and use counts)."""

    def __init__(self, spec: TableSpec, label: str) -> None:
        self.spec = spec
        self.label = label
        self.sketch = Sketch(spec) if needs_sketch(spec) else None
        self.counters = Counters()

    def _admitted(self, new: np.ndarray) -> np.ndarray:
        return new if self.sketch is None else new[self.sketch.admits(new)]

    def _victims(self, storage, keys: np.ndarray, protected: np.ndarray, step: int,
                 incoming: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(ttl victims, capacity victims, room for admitted keys); changes nothing. Costs
        a pass over the held rows only when TTL is on or room has to be made."""
        limit, ttl = self.spec.max_rows_per_shard, self.spec.ttl_steps
        none = np.empty(0, dtype=np.int64)
        if not ttl and (not limit or storage.num_rows + incoming <= limit):
            return none, none, incoming
        held = storage.row_ids()
        last_used, uses = storage.meta()
        free = ~np.isin(held, keys) & ~np.isin(held, protected)
        expired = free & (step - last_used >= ttl) if ttl else np.zeros(len(held), bool)
        room = limit - (len(held) - int(expired.sum())) if limit else incoming
        need = incoming - room
        if need <= 0:
            return held[expired], none, incoming
        if self.spec.eviction == "none":
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.label}: {incoming} admitted keys would exceed "
                               f"max_rows_per_shard={limit} (holding {len(held)}); raise it, "
                               f"add shards, or set eviction='lru' or 'lfu'")
        pool = np.flatnonzero(free & ~expired)
        order = eviction_order(self.spec.eviction, held[pool], last_used[pool], uses[pool])
        chosen = pool[order[:need]]
        return held[expired], held[chosen], room + len(chosen)

    def update(self, storage, keys: np.ndarray, protected: np.ndarray,
               step: int) -> tuple[np.ndarray, Change]:
        """Admit and evict for an update of unique `keys` at `step` (see the module's
        steps); returns (which keys' gradients apply, the change). Checks come first: a
        refusal changes nothing."""
        _, found = storage.find(keys)
        new = keys[~found]
        admitted = np.sort(self._admitted(new))
        ttl, capacity, room = self._victims(storage, keys, protected, step, len(admitted))
        admitted = admitted[:room]  # sorted keys: the highest are dropped
        victims = np.concatenate([ttl, capacity])
        change = Change(admitted, storage.extract(victims), storage.used_meta(keys[found]),
                        new if self.sketch is not None else new[:0],
                        dataclasses.replace(self.counters))
        if self.sketch is not None:
            self.sketch.add(new)
        storage.remove(victims)
        storage.locate(admitted, create=True)
        applies = found | np.isin(keys, admitted)
        storage.mark_used(keys[applies], step)
        c = self.counters
        c.admitted += len(admitted)
        c.evicted_ttl += len(ttl)
        c.evicted_capacity += len(capacity)
        c.dropped_gradients += int(len(keys) - applies.sum())
        return applies, change

    def undo(self, storage, change: Change) -> None:
        """Take back one `update` (the latest one not taken back yet)."""
        storage.remove(change.admitted)
        keys, values, slots, last_used, uses = change.evicted
        storage.adopt(keys, values, slots)
        storage.set_meta(keys, last_used, uses)
        storage.set_meta(*change.used)
        if self.sketch is not None:
            self.sketch.add(change.sighted, sign=-1)
        self.counters = change.counters

    def count_defaults(self, n: int) -> None:
        self.counters.default_rows += n

    def count_evicted(self, n: int) -> None:
        self.counters.evicted_capacity += n

    # ---- imports (live resharding) -------------------------------------------------------
    def import_room(self, storage, keys: np.ndarray, last_used: np.ndarray,
                    uses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For an import of unique `keys` with their use history: (which incoming keys to
        keep, held keys to evict), so that the shard holds at most max_rows_per_shard. The
        policy ranks the incoming rows and the held ones alike (an incoming row replaces
        the held row of its key); changes nothing. Past the bound without eviction, the
        import is refused (RESOURCE_EXHAUSTED)."""
        limit, keep = self.spec.max_rows_per_shard, np.ones(len(keys), dtype=bool)
        held = storage.row_ids()
        others = ~np.isin(held, keys)  # held rows the import does not replace
        need = int(others.sum()) + len(keys) - limit
        if not limit or need <= 0:
            return keep, held[:0]
        if self.spec.eviction == "none":
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.label}: importing {len(keys)} rows would make "
                               f"{need + limit} rows, over max_rows_per_shard={limit} "
                               f"(holding {len(held)}); nothing was imported: raise "
                               f"max_rows_per_shard, import into more shards, or create the "
                               f"table with eviction='lru' or 'lfu' to evict by use")
        last_held, uses_held = storage.meta()
        order = eviction_order(self.spec.eviction, np.concatenate([held[others], keys]),
                               np.concatenate([last_held[others], last_used]),
                               np.concatenate([uses_held[others], uses]))
        victims, kept_held = order[:need], int(others.sum())
        keep[victims[victims >= kept_held] - kept_held] = False
        return keep, held[others][victims[victims < kept_held]]

    # ---- checkpoints ---------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """Arrays a checkpoint keeps besides the rows: the counters and the sketch."""
        out = {"counters": np.array(list(self.counters.as_dict().values()), dtype=np.int64)}
        if self.sketch is not None:
            out["sketch"] = self.sketch.counts.copy()
        return out

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Adopt `state()` arrays (missing ones: start afresh)."""
        counters = state.get("counters")
        self.counters = Counters(*map(int, counters)) if counters is not None else Counters()
        if self.sketch is not None:
            sketch = state.get("sketch")
            self.sketch.counts[...] = 0 if sketch is None else sketch
