"""Request generators of the wire fuzzer (tests/server/test_fuzz.py): every RPC of ParameterServer.

Each method has a `Strategy`: `valid` builds a correct request (aimed at a sandbox table, or
one that only reads), `attack` a structurally valid but adversarial one. `cases` turns them
into raw bytes in four ways: the valid request as is, its bytes mutated (bit flips,
truncation, splices, varint bombs, ...), random bytes or another method's request, and the
attack. An attack aimed at a protected ("victim") table carries at least one defect the
server must refuse (`Case.must_refuse`), so the victims must come out unchanged; whatever
reaches a sandbox table may legitimately change it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
from google.protobuf import descriptor as _descriptor

from parallax.protocol import wire
from parallax.protocol.checkpoint_names import new_name
from parallax.protocol.routing import ShardRouter
from parallax.protocol.specs import SGD, Adagrad, Adam, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2

SERVICE = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"]
METHODS = sorted(m.name for m in SERVICE.methods)
STREAMING = frozenset(m.name for m in SERVICE.methods if m.client_streaming)

_UNIFORM = Initializer("uniform", seed=5)
VICTIMS = {spec.name: spec for spec in (
    TableSpec(name="victim_fixed", vocabulary_size=300, dim=4, shard_count=2, num_workers=2,
              sync_mode="async", optimizer=Adam(learning_rate=0.1), initializer=_UNIFORM),
    TableSpec(name="victim_hashed", hashed_keys=True, vocabulary_size=0, max_rows_per_shard=64,
              dim=3, dtype="float64", sync_mode="async", optimizer=Adagrad(learning_rate=0.5)),
    TableSpec(name="victim_sync", vocabulary_size=50, dim=2, dtype="float64", num_workers=2,
              aggregation="mean", optimizer=SGD(learning_rate=0.2, momentum=0.9),
              initializer=_UNIFORM),
)}
SANDBOX = {spec.name: spec for spec in (
    TableSpec(name="sbx_async", vocabulary_size=1000, dim=4, num_workers=4, sync_mode="async",
              optimizer=SGD(learning_rate=0.1)),
    TableSpec(name="sbx_hashed", hashed_keys=True, vocabulary_size=0, max_rows_per_shard=5000,
              dim=4, num_workers=4, sync_mode="async", optimizer=Adagrad(learning_rate=0.1)),
    TableSpec(name="sbx_sync", vocabulary_size=100, dim=4, optimizer=SGD(learning_rate=0.1)),
    TableSpec(name="sbx_adam", vocabulary_size=100, dim=2, dtype="float64", num_workers=2,
              sync_mode="async", optimizer=Adam(learning_rate=0.01)),
    TableSpec(name="sbx_dynamic", hashed_keys=True, max_rows_per_shard=64, dim=4,
              num_workers=2, sync_mode="async", optimizer=Adagrad(learning_rate=0.1),
              admit_after=2, admit_probability=0.5, eviction="lru", ttl_steps=20),
)}
HASHED_KEYS = np.array([-(2**62), -7, 0, 3, 11, 2**40 + 1, 2**63 - 1], np.int64)
SLOTS = {"sgd": [], "adagrad": ["accumulator"], "adam": ["m", "v"]}  # as the server names them
BASE_CHECKPOINT = "base"  # a checkpoint of the victims, made before fuzzing
SAVES = "fuzz-saves"      # where valid Save requests write

INT32 = [-1, -(2**31), 2**31 - 1, 0, 1, 2, 3, 65536, 65537]
INT64 = [-1, -(2**63), 2**63 - 1, 2**62, 10**12, 0, 1, 2, 3]
UINT64 = [0, 1, 2**63, 2**64 - 1]
DOUBLES = [math.nan, math.inf, -math.inf, -1.0, 0.0, -0.0, 5e-324, 1e308, 3.5e38, 1e30]
STRINGS = ["", "nope", "x" * 129, "y" * 20_000, "w" * 1_000_000, "victim_fixed/../sbx_async", "a\x00b",
           "名前", " victim_fixed", "victim_fixed\n", "../../etc", "/tmp/abs", ".", "..",
           "fuzz-saves/" + "z" * 300, "d/" * 2100, "ckpt-00000000000000000000-0000000g"]


@dataclass(frozen=True)
class Case:
    """One fuzz request: raw bytes (a stream's chunks for InitRows) and what it must do."""

    method: str
    payload: bytes | tuple[bytes, ...]
    label: str
    must_refuse: bool = False


@dataclass
class Strategy:
    valid: Callable[[np.random.Generator], object]
    attack: Callable[[np.random.Generator], tuple[object, bool, str]]


Request = object  # a message, or a list of messages (a stream)


# ---- building blocks -------------------------------------------------------------------
def pick(rng: np.random.Generator, items):
    return items[int(rng.integers(len(items)))]


def tensor(array) -> ps_pb2.Tensor:
    return wire.encode(np.asarray(array))


def owned_ids(rng, spec: TableSpec, shard: int, n: int) -> np.ndarray:
    """n distinct ids shard `shard` of a table owns (known keys for a hashed victim)."""
    if spec.hashed_keys:
        if spec.name in VICTIMS:
            return rng.permutation(HASHED_KEYS)[:n]
        return rng.integers(-(2**40), 2**40, size=n)
    ids = ShardRouter(spec.shard_count, spec.vocabulary_size, spec.partition).global_ids(shard)
    return rng.choice(ids, size=min(n, len(ids)), replace=False)


def rows(rng, spec: TableSpec, n: int) -> np.ndarray:
    return rng.normal(size=(n, spec.dim)).astype(spec.dtype)


def _shard(rng, spec: TableSpec) -> int:
    return int(rng.integers(spec.shard_count))


def _pull(rng, spec: TableSpec, min_step: int = 0) -> ps_pb2.PullRequest:
    shard = _shard(rng, spec)
    return ps_pb2.PullRequest(table=spec.name, shard_index=shard, min_step=min_step,
                              ids=tensor(owned_ids(rng, spec, shard, int(rng.integers(0, 9)))))


def _push(rng, spec: TableSpec, step: int, worker: int = 0) -> ps_pb2.PushRequest:
    shard = _shard(rng, spec)
    ids = owned_ids(rng, spec, shard, int(rng.integers(1, 6)))
    return ps_pb2.PushRequest(table=spec.name, shard_index=shard, step=step, worker=worker,
                              ids=tensor(ids), grads=tensor(rows(rng, spec, len(ids))),
                              session=int(rng.integers(1, 2**63)))


def _sandbox_push(rng) -> ps_pb2.PushRequest:
    spec = pick(rng, list(SANDBOX.values()))
    worker = int(rng.integers(spec.num_workers))
    return _push(rng, spec, int(rng.integers(0, 4)), worker)


def _victim_push(rng) -> tuple[ps_pb2.PushRequest, TableSpec]:
    """A push to a victim that would be applied (or buffered) if it were not spoilt."""
    spec = pick(rng, list(VICTIMS.values()))
    step = 2 if spec.sync_mode == "sync" else int(rng.integers(10, 1000))
    return _push(rng, spec, step, int(rng.integers(spec.num_workers))), spec


# ---- generic attacks on any field ----------------------------------------------------------
_EXTREMES = {
    _descriptor.FieldDescriptor.CPPTYPE_INT32: INT32,
    _descriptor.FieldDescriptor.CPPTYPE_INT64: INT64,
    _descriptor.FieldDescriptor.CPPTYPE_UINT64: UINT64,
    _descriptor.FieldDescriptor.CPPTYPE_DOUBLE: DOUBLES,
    _descriptor.FieldDescriptor.CPPTYPE_BOOL: [True, False],
    _descriptor.FieldDescriptor.CPPTYPE_ENUM: [0, 1, 4, 5, 99, -1, 2**31 - 1],
    _descriptor.FieldDescriptor.CPPTYPE_STRING: STRINGS,
}


def tensor_attack(rng, good: ps_pb2.Tensor) -> ps_pb2.Tensor:
    """A malformed or hostile variant of a well-formed tensor."""
    bad = ps_pb2.Tensor()
    bad.CopyFrom(good)
    how = int(rng.integers(12))
    content = bytes(good.content)
    if how == 0:
        bad.dtype = int(pick(rng, [0, 6, 99, -1]))
    elif how == 1:
        bad.dtype = int(pick(rng, [1, 2, 3, 4, 5]))  # another dtype, same bytes
    elif how == 2:
        bad.shape[:] = [-1, *bad.shape[1:]] if bad.shape else [-1]
    elif how == 3:
        bad.shape[:] = pick(rng, [[2**62, 4], [2**32, 2**32], [2**31, 2**31, 0], [0, 2**62]])
    elif how == 4:
        bad.shape[:] = pick(rng, [[], [1, 1, 1], [len(content)], [1, 0]])
    elif how == 5:
        bad.content = content[:max(0, len(content) - int(rng.integers(1, 9)))]
    elif how == 6:
        bad.content = content + bytes(int(rng.integers(1, 9)))
    elif how == 7:  # empty, with the trailing shape: stated, not allocated (a shape spoilt
        bad.shape[:] = [0, *good.shape[1:]]  # by an earlier attack may be too big for numpy)
        bad.content = b""
    elif how == 8:
        bad.CopyFrom(_hostile_values(rng, good))
    elif how == 9:
        bad.ClearField("content")
    elif how == 10:
        bad.CopyFrom(tensor(np.ones((1, 200_000), np.float32)))
    else:
        bad.CopyFrom(tensor(rng.integers(-(2**63), 2**63 - 1, size=(3,), dtype=np.int64)))
    return bad


def _hostile_values(rng, good: ps_pb2.Tensor) -> ps_pb2.Tensor:
    """Same dtype and shape, with extreme values (NaN, Inf, the dtype's limits)."""
    try:
        array = wire.decode(good).copy()
    except wire.WireError:  # spoilt by an earlier attack already
        return good
    if array.size == 0:
        return good
    flat = array.reshape(-1)
    if array.dtype.kind == "f":
        info = np.finfo(array.dtype)
        flat[int(rng.integers(flat.size))] = pick(rng, [np.nan, np.inf, -np.inf, info.max,
                                                        info.tiny / 2])
    else:
        info = np.iinfo(array.dtype)
        flat[int(rng.integers(flat.size))] = pick(rng, [info.min, info.max, -1])
    return tensor(array)


def field_attack(rng, message, depth: int = 0) -> str:
    """Spoil one field of `message` (possibly nested) with an extreme value; its name."""
    fields = message.DESCRIPTOR.fields
    f = fields[int(rng.integers(len(fields)))]
    name = f"{message.DESCRIPTOR.name}.{f.name}"
    if f.message_type is not None:
        return name + _message_field_attack(rng, message, f, depth)
    value = pick(rng, _EXTREMES[f.cpp_type])
    if f.type == f.TYPE_BYTES:
        value = value.encode()
    if f.label == f.LABEL_REPEATED:
        long = isinstance(value, (str, bytes)) and len(value) > 100
        getattr(message, f.name)[:] = [value] * int(pick(rng, [0, 1, 2, 3 if long else 5000]))
    else:
        setattr(message, f.name, value)
    return f"{name}={value!r:.40}"


def _message_field_attack(rng, message, f, depth: int) -> str:
    if f.label == f.LABEL_REPEATED:
        items = getattr(message, f.name)
        if not len(items) or rng.random() < 0.3:
            snapshot = list(items)
            small = sum(item.ByteSize() for item in snapshot) < 4096
            copies = int(pick(rng, [0, 2, 3000] if small else [0, 2, 3]))
            del items[:]
            for _ in range(copies if snapshot else 0):
                items.add().CopyFrom(pick(rng, snapshot))
            return f"x{copies}"
        return "/" + field_attack(rng, items[int(rng.integers(len(items)))], depth + 1)
    inner = getattr(message, f.name)
    if f.message_type.name == "Tensor":
        inner.CopyFrom(tensor_attack(rng, inner))
        return "(tensor)"
    if depth > 3:
        message.ClearField(f.name)
        return "(cleared)"
    return "/" + field_attack(rng, inner, depth + 1)


def attacked(rng, message, times: int | None = None) -> str:
    """1-3 generic field attacks on `message`; what they did."""
    count = int(rng.integers(1, 4)) if times is None else times
    return ", ".join(field_attack(rng, message) for _ in range(count))


# ---- defects a victim-bound request is sure to be refused for ----------------------------
def count_of(ids: ps_pb2.Tensor) -> int:
    """The rows an ids tensor claims, when that is a sane count (else 1)."""
    n = ids.shape[0] if ids.shape else 1
    return n if 0 < n <= 1000 else 1


def _nan_rows(spec: TableSpec, n: int) -> ps_pb2.Tensor:
    values = np.ones((n, spec.dim), spec.dtype)
    values[-1, -1] = np.nan
    return tensor(values)


def spoil_push(rng, push: ps_pb2.PushRequest, spec: TableSpec) -> str:
    """One defect that makes a push to `spec`'s table invalid whatever else it carries."""
    n = count_of(push.ids)
    defects = {
        "nan": lambda: push.grads.CopyFrom(_nan_rows(spec, n)),
        "worker": lambda: setattr(push, "worker", pick(rng, [-1, spec.num_workers, 2**31 - 1])),
        "dim": lambda: push.grads.CopyFrom(tensor(np.ones((n, spec.dim + 1), spec.dtype))),
        "dtype": lambda: push.grads.CopyFrom(tensor(np.ones((n, spec.dim), np.float16))),
        "chunk": lambda: (setattr(push, "chunk_count", 2), setattr(push, "chunk_index", 2)),
        "lr": lambda: setattr(push, "learning_rate", pick(rng, [-1.0, math.nan, math.inf])),
        "rows": lambda: push.grads.CopyFrom(tensor(np.ones((n + 1, spec.dim), spec.dtype))),
        "ids": lambda: push.ids.CopyFrom(tensor(np.ones((n, 2), np.int64))),
    }
    if spec.sync_mode == "sync":
        defects["step"] = lambda: setattr(push, "step", pick(rng, [1, 3, -1, 2**63 - 1]))
    if spec.sync_mode == "async":
        defects["overflow"] = lambda: _overflowing(rng, push, spec)
    if not spec.hashed_keys:
        defects["vocab"] = lambda: push.ids.CopyFrom(tensor([spec.vocabulary_size] * n))
    name = pick(rng, sorted(defects))
    defects[name]()
    return f"defect {name}"


def _overflowing(rng, push: ps_pb2.PushRequest, spec: TableSpec) -> None:
    """Finite gradients whose update is not finite (refused while applying: tests undo)."""
    shard = push.shard_index if 0 <= push.shard_index < spec.shard_count else 0
    ids = owned_ids(rng, spec, shard, 3)
    push.ids.CopyFrom(tensor(ids))
    push.grads.CopyFrom(tensor(np.full((len(ids), spec.dim), np.finfo(spec.dtype).max,
                                       spec.dtype)))
    push.learning_rate = 1e30


# ---- the strategies, one per RPC ---------------------------------------------------------------
_created = iter(range(10**9))


def _new_spec(rng) -> TableSpec:
    base = pick(rng, list(SANDBOX.values()))
    kw = {f: getattr(base, f) for f in base.__dataclass_fields__}
    return TableSpec(**{**kw, "name": f"sbx_new_{next(_created)}"})


def create_valid(rng):
    spec = _new_spec(rng) if rng.random() < 0.7 else pick(rng, list(VICTIMS.values()))
    return ps_pb2.CreateTableRequest(spec=spec.to_proto(), shard_index=_shard(rng, spec))


def create_attack(rng):
    request = create_valid(rng)
    label = attacked(rng, request)
    if request.spec.name not in VICTIMS:
        return request, False, label
    if rng.random() < 0.5:  # an identical spec would be a no-op: make it differ
        request.spec.dim += 1
        return request, True, label + ", victim spec differs"
    request.spec.shard_count = VICTIMS[request.spec.name].shard_count + 1
    request.shard_index = request.spec.shard_count - 1  # a shard the victim does not have
    return request, True, label + ", a new shard of a victim with another shard_count"


def delete_valid(rng):
    return ps_pb2.DeleteTableRequest(table=f"sbx_new_{int(rng.integers(50))}")


def delete_attack(rng):
    spec = pick(rng, list(VICTIMS.values()))
    request = ps_pb2.DeleteTableRequest(table=spec.name)
    label = attacked(rng, request, 1)
    request.shard_index = int(pick(rng, [-1, spec.shard_count, 2**31 - 1]))
    return request, True, label


def _chunks(rng, spec: TableSpec, count: int) -> list[ps_pb2.InitRowsChunk]:
    ids = owned_ids(rng, spec, 0, 4 * count)
    return _marked([ps_pb2.InitRowsChunk(table=spec.name, ids=tensor(part),
                                         values=tensor(rows(rng, spec, len(part))))
                    for part in np.array_split(ids, count)])


def _marked(chunks: list[ps_pb2.InitRowsChunk]) -> list[ps_pb2.InitRowsChunk]:
    """`chunks` with the final one marked last, as a whole stream's is."""
    for k, chunk in enumerate(chunks):
        chunk.last = k == len(chunks) - 1
    return chunks


def init_valid(rng):
    return _chunks(rng, SANDBOX[pick(rng, ["sbx_async", "sbx_hashed", "sbx_dynamic"])],
                   int(rng.integers(1, 4)))


def init_attack(rng):
    victim = rng.random() < 0.6
    spec = pick(rng, list(VICTIMS.values()) if victim else list(SANDBOX.values()))
    chunks = _chunks(rng, spec, int(rng.integers(1, 4)))
    label = attacked(rng, chunks[int(rng.integers(len(chunks)))])
    if victim:
        label += ", " + _spoil_stream(rng, chunks, spec)
    return chunks, victim, label


def _spoil_stream(rng, chunks: list, spec: TableSpec) -> str:
    last = chunks[-1]
    how = pick(rng, ["repeat", "nan", "other table", "empty"])
    if how == "repeat":
        chunks.append(ps_pb2.InitRowsChunk())
        chunks[-1].CopyFrom(chunks[0])
    elif how == "nan":
        last.values.CopyFrom(_nan_rows(spec, count_of(last.ids)))
    elif how == "other table":
        chunks.append(ps_pb2.InitRowsChunk(table="sbx_async", ids=last.ids, values=last.values))
    else:
        chunks.clear()
    _marked(chunks)  # (refused for what it spoiled, not for a chunk after the last)
    return f"stream {how}"


def pull_valid(rng):
    spec = pick(rng, [VICTIMS["victim_fixed"], VICTIMS["victim_sync"], SANDBOX["sbx_hashed"]])
    return _pull(rng, spec, int(rng.integers(0, 3)))


def pull_attack(rng):
    if rng.random() < 0.25:  # a hashed victim creates rows on pull: must be refused
        request = _pull(rng, VICTIMS["victim_hashed"])
        label = attacked(rng, request)
        request.ids.CopyFrom(tensor(np.zeros((1, 1), np.int64)))
        return request, True, label + ", 2-D ids"
    request = pull_valid(rng)
    if rng.random() < 0.2:
        request.ids.CopyFrom(tensor(np.zeros(int(pick(rng, [200_000, 300_000])), np.int64)))
        return request, False, "many ids"
    return request, False, attacked(rng, request)


def push_valid(rng):
    return _sandbox_push(rng)


def push_attack(rng):
    if rng.random() < 0.5:
        request = _sandbox_push(rng)
        return request, False, attacked(rng, request)
    request, spec = _victim_push(rng)
    label = attacked(rng, request) if rng.random() < 0.5 else "clean"
    return request, True, label + ", " + spoil_push(rng, request, spec)


def wait_valid(rng):
    spec = pick(rng, list(VICTIMS.values()) + list(SANDBOX.values()))
    return ps_pb2.StepRequest(table=spec.name, shard_index=_shard(rng, spec),
                              min_step=int(rng.integers(0, 3)))


def wait_attack(rng):
    request = wait_valid(rng)
    return request, False, attacked(rng, request)


def barrier_valid(rng):
    return ps_pb2.BarrierRequest(name=f"solo-{int(rng.integers(4))}", rank=0, count=1)


def barrier_attack(rng):
    request = ps_pb2.BarrierRequest(name="fuzz", rank=int(rng.integers(3)), count=3)
    return request, False, attacked(rng, request)


def save_valid(rng):
    phase = int(pick(rng, [ps_pb2.SAVE_PREPARE, ps_pb2.SAVE_COMMIT, ps_pb2.SAVE_ABORT]))
    return ps_pb2.SaveRequest(path=SAVES, checkpoint=new_name(), phase=phase,
                              keep=int(rng.integers(1, 4)),
                              tables=list(VICTIMS)[:int(rng.integers(0, 4))])


def save_attack(rng):
    request = save_valid(rng)
    return request, False, attacked(rng, request)


def restore_valid(rng):
    return ps_pb2.RestoreRequest(path=pick(rng, [BASE_CHECKPOINT, SAVES]),
                                 tables=list(VICTIMS)[:int(rng.integers(1, 4))],
                                 verify_only=bool(rng.random() < 0.5))


def restore_attack(rng):
    request = restore_valid(rng)
    return request, False, attacked(rng, request)


def stats_valid(rng):
    return ps_pb2.StatsRequest(tables=list(VICTIMS)[:int(rng.integers(0, 4))])


def data_plane_valid(rng):
    return ps_pb2.DataPlaneRequest()


def data_plane_attack(rng):
    """DataPlaneRequest has no fields: another message's bytes (unknown fields) instead."""
    request = ps_pb2.StatsRequest(tables=[pick(rng, STRINGS)])
    return request, False, "a StatsRequest's bytes as a DataPlaneRequest"


def stats_attack(rng):
    request = stats_valid(rng)
    return request, False, attacked(rng, request)


def export_valid(rng):
    spec = pick(rng, list(VICTIMS.values()) + list(SANDBOX.values()))
    return ps_pb2.ExportRowsRequest(table=spec.name, shard_index=_shard(rng, spec),
                                    offset=int(rng.integers(0, 20)),
                                    max_rows=int(rng.integers(0, 50)),
                                    changed_only=bool(rng.random() < 0.5))


def export_attack(rng):
    request = export_valid(rng)
    return request, False, attacked(rng, request)


def _shard_rows(rng, spec: TableSpec) -> ps_pb2.ShardRows:
    ids = owned_ids(rng, spec, 0, int(rng.integers(1, 6)))
    message = ps_pb2.ShardRows(table=spec.name, step=int(rng.integers(0, 5)), ids=tensor(ids),
                               values=tensor(rows(rng, spec, len(ids))))
    for name in SLOTS[spec.optimizer.kind]:
        message.slot_names.append(name)
        message.slots.add().CopyFrom(tensor(np.abs(rows(rng, spec, len(ids)))))
    if spec.dynamic and rng.random() < 0.5:  # a dynamic table's use history
        message.uses.CopyFrom(tensor(rng.integers(0, 9, len(ids))))
        message.last_used.CopyFrom(tensor(rng.integers(0, 5, len(ids))))
    return message


def import_valid(rng):
    return _shard_rows(rng, SANDBOX[pick(rng, ["sbx_async", "sbx_adam", "sbx_hashed",
                                               "sbx_dynamic"])])


def import_attack(rng):
    if rng.random() < 0.5:
        request = import_valid(rng)
        return request, False, attacked(rng, request)
    spec = pick(rng, list(VICTIMS.values()))
    request = _shard_rows(rng, spec)
    label = attacked(rng, request) if rng.random() < 0.5 else "clean"
    how = pick(rng, ["nan", "slot name", "step", "dim"])
    n = count_of(request.ids)
    if how == "nan":
        request.values.CopyFrom(_nan_rows(spec, n))
    elif how == "slot name":
        request.slot_names.append("bogus")
    elif how == "step":
        request.step = -1
    else:
        request.values.CopyFrom(tensor(np.ones((n, spec.dim + 1), spec.dtype)))
    return request, True, f"{label}, defect {how}"


def pull_many_valid(rng):
    return ps_pb2.PullManyRequest(parts=[pull_valid(rng) for _ in range(int(rng.integers(1, 5)))])


def pull_many_attack(rng):
    request = pull_many_valid(rng)
    label = attacked(rng, request)
    if rng.random() < 0.3:  # a hashed victim's part, with a part that spoils the request
        request.parts.append(_pull(rng, VICTIMS["victim_hashed"]))
        request.parts.add(table="victim_fixed", ids=tensor(np.array([1.5])))
        return request, True, label + ", hashed victim part and float ids"
    return request, False, label


def push_many_valid(rng):
    return ps_pb2.PushManyRequest(parts=[_sandbox_push(rng) for _ in range(int(rng.integers(1, 4)))])


def push_many_attack(rng):
    request = push_many_valid(rng)
    if rng.random() < 0.5:
        return request, False, attacked(rng, request)
    victim, spec = _victim_push(rng)
    bad = victim if rng.random() < 0.5 else _victim_push(rng)[0]
    bad_spec = VICTIMS[bad.table]
    label = spoil_push(rng, bad, bad_spec)
    request.parts.append(victim)
    if bad is not victim:
        request.parts.append(bad)
    order = rng.permutation(len(request.parts))
    shuffled = [request.parts[int(i)] for i in order]
    del request.parts[:]
    request.parts.extend(shuffled)
    return request, True, f"victim part in {len(order)}, {label}"


STRATEGIES: dict[str, Strategy] = {
    "CreateTable": Strategy(create_valid, create_attack),
    "DeleteTable": Strategy(delete_valid, delete_attack),
    "InitRows": Strategy(init_valid, init_attack),
    "Pull": Strategy(pull_valid, pull_attack),
    "Push": Strategy(push_valid, push_attack),
    "WaitStep": Strategy(wait_valid, wait_attack),
    "Barrier": Strategy(barrier_valid, barrier_attack),
    "Save": Strategy(save_valid, save_attack),
    "Restore": Strategy(restore_valid, restore_attack),
    "Stats": Strategy(stats_valid, stats_attack),
    "ExportRows": Strategy(export_valid, export_attack),
    "ImportRows": Strategy(import_valid, import_attack),
    "PullMany": Strategy(pull_many_valid, pull_many_attack),
    "PushMany": Strategy(push_many_valid, push_many_attack),
    "DataPlane": Strategy(data_plane_valid, data_plane_attack),
}


# ---- bytes ----------------------------------------------------------------------------------
def serialized(request: Request) -> bytes | tuple[bytes, ...]:
    if isinstance(request, list):
        return tuple(m.SerializeToString() for m in request)
    return request.SerializeToString()


def _varint_bomb(rng) -> bytes:
    """A field whose length or value claims far more than is there."""
    return pick(rng, [b"\x0a\xff\xff\xff\xff\x0f", b"\x2a\xff\xff\xff\xff\xff\xff\xff\xff\x7f",
                      b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                      b"\x2a\x80\x80\x80\x80\x10", b"\x07", b"\x0b\x0c", b"\x3a"])


def mutate_bytes(rng, data: bytes, other: bytes) -> tuple[bytes, str]:
    """One mutation of a message's bytes; `other` is some request's bytes to splice in."""
    buf = bytearray(data)
    at = int(rng.integers(len(buf) + 1))
    how = int(rng.integers(9))
    if how == 0 and buf:
        buf[min(at, len(buf) - 1)] ^= 1 << int(rng.integers(8))
    elif how == 1 and buf:
        buf[min(at, len(buf) - 1)] = int(pick(rng, [0, 0x7F, 0x80, 0xFF, rng.integers(256)]))
    elif how == 2:
        buf[at:at] = rng.bytes(int(rng.integers(1, 16)))
    elif how == 3:
        del buf[at:at + int(rng.integers(1, 64))]
    elif how == 4:
        del buf[at:]
    elif how == 5:
        buf[at:at] = buf[at:at + int(rng.integers(1, 256))] * int(rng.integers(2, 20))
    elif how == 6:
        buf += other  # concatenated messages merge: repeated fields add up
    elif how == 7:
        buf[at:at] = _varint_bomb(rng)
    else:
        buf = bytearray(data * int(rng.integers(2, 5)))
    return bytes(buf), f"mutation {how}@{at}"


def mutate(rng, payload, other: bytes) -> tuple[bytes | tuple[bytes, ...], str]:
    """Several mutations of one request's bytes, or of a stream (chunks dropped, repeated,
    swapped or mutated)."""
    if not isinstance(payload, tuple):
        labels = []
        for _ in range(int(rng.integers(1, 4))):
            payload, label = mutate_bytes(rng, payload, other)
            labels.append(label)
        return payload, ", ".join(labels)
    chunks = list(payload)
    how = int(rng.integers(4))
    if how == 0 and chunks:
        chunks.pop(int(rng.integers(len(chunks))))
    elif how == 1 and chunks:
        chunks.append(pick(rng, chunks))
    elif how == 2:
        chunks.insert(int(rng.integers(len(chunks) + 1)), b"")
    else:
        i = int(rng.integers(len(chunks))) if chunks else 0
        chunks[i:i + 1] = [mutate(rng, chunks[i] if chunks else b"", other)[0]]
    return tuple(chunks), f"stream mutation {how}"


def _random_payload(rng, method: str, other: bytes):
    data = other if rng.random() < 0.5 else rng.bytes(int(rng.integers(0, 2048)))
    if method in STREAMING:
        return tuple(data for _ in range(int(rng.integers(0, 3)))), "random stream"
    return data, "random bytes" if data is not other else "another method's request"


def cases(seed: int, per_method: int) -> Iterator[Case]:
    """`per_method` cases of every method, interleaved, all drawn from `seed`."""
    rng = np.random.default_rng(seed)
    for _ in range(per_method):
        for method in METHODS:
            yield one_case(rng, method)


# Methods whose valid requests never name a victim: the only bytes spliced into another
# method's request (merged protobuf fields could otherwise turn a sandbox push into a valid
# push to a victim, a legitimate change).
SPLICEABLE = ["Barrier", "DeleteTable", "ImportRows", "InitRows", "Push", "PushMany"]


def one_case(rng, method: str) -> Case:
    strategy = STRATEGIES[method]
    other = serialized(STRATEGIES[pick(rng, SPLICEABLE)].valid(rng))
    other = b"".join(other) if isinstance(other, tuple) else other
    kind = rng.random()
    if kind < 0.4:
        request, must_refuse, label = strategy.attack(rng)
        return Case(method, serialized(request), f"attack: {label}", must_refuse)
    if kind < 0.85:
        payload, label = mutate(rng, serialized(strategy.valid(rng)), other)
        return Case(method, payload, label)
    if kind < 0.93:
        payload, label = _random_payload(rng, method, other)
        return Case(method, payload, label)
    return Case(method, serialized(strategy.valid(rng)), "valid")
