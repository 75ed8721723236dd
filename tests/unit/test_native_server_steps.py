"""Whole training steps through the server's real PushManyPacked/PullManyPacked handlers (in
this process, no socket), once on the compiled kernels and once on numpy (PARALLAX_NATIVE=1
and 0): every answer, every refusal and every table's rows, slots and step must be the same
bytes. Tables of every kind the kernels serve: fixed (two shards, mod and range) and hashed
keys, sync with a mean over workers and async, float16 and bfloat16 wire dtypes, optimizers
with slots; bad requests among the good ones."""
from __future__ import annotations

import numpy as np
import pytest

from parallax import native
from parallax.env import NATIVE_ENV
from parallax.protocol import bulk_codec
from parallax.protocol.packed_codec import PullManyParts, PushManyParts
from parallax.protocol.specs import SGD, Adagrad, Adam, Ftrl, Initializer, Lion, TableSpec
from parallax.ps.v1 import ps_pb2
from parallax_ps import native_path
from parallax_ps.dataplane import _Context, _Refused
from parallax_ps.service import ParameterServerService, request_deserializer

pytestmark = pytest.mark.skipif(native.kernels() is None,
                                reason=f"compiled kernels: {native.describe()}")
WORKERS, DIM, STEPS = 3, 6, 12
TABLES = [
    TableSpec("fixed_mod", DIM, vocabulary_size=900, shard_count=2, num_workers=WORKERS,
              optimizer=Adam(0.01), aggregation="mean", initializer=Initializer("uniform", seed=3)),
    TableSpec("fixed_range", DIM, vocabulary_size=500, shard_count=2, partition="range",
              num_workers=WORKERS, optimizer=SGD(0.1, momentum=0.9), wire_dtype="float16"),
    TableSpec("hashed", DIM, hashed_keys=True, num_workers=WORKERS, optimizer=Adagrad(0.2),
              wire_dtype="bfloat16", initializer=Initializer("normal", seed=5)),
    TableSpec("async", DIM, vocabulary_size=300, num_workers=WORKERS, sync_mode="async",
              optimizer=Lion(0.01)),
    TableSpec("ftrl", DIM, vocabulary_size=300, num_workers=WORKERS, optimizer=Ftrl(0.1)),
]


def _ids(rng, spec: TableSpec, shard: int) -> np.ndarray:
    if spec.hashed_keys:
        return rng.integers(-(1 << 62), 1 << 62, 40) if rng.random() < 0.3 else \
            rng.integers(0, 200, 60)
    owner = np.arange(spec.vocabulary_size)
    if spec.shard_count > 1:
        block = -(-spec.vocabulary_size // spec.shard_count)
        owner = owner[(owner // block if spec.partition == "range" else
                       owner % spec.shard_count) == shard]
    return rng.choice(owner, min(len(owner), 80), replace=False)


def _push(rng, step: int, worker: int, parts, spoil: str = "") -> bytes:
    headers, rows = [], []
    for spec, shard in parts:
        ids = _ids(rng, spec, shard)
        if spec.hashed_keys:
            ids = np.unique(ids)  # what the client sends: each id once
        grads = (rng.standard_normal((len(ids), DIM)) * rng.choice([1e-2, 1, 30])
                 ).astype(np.float32)
        if spoil == "nan" and spec.name == "fixed_mod":
            grads[len(ids) // 2, 1] = np.nan
        if spoil == "foreign" and spec.name == "fixed_range":
            ids[-1] = spec.vocabulary_size + 7
        headers.append((bulk_codec.PushHeader(spec.name, shard, step, worker, 0.0, 0, 1, 0),
                        len(ids), DIM, np.dtype(np.float32)))
        rows.append((ids, grads))

    def fill(i, ids, grads):
        ids[...], grads[...] = rows[i]
    return PushManyParts(headers, fill).packed()


def _run() -> tuple[list, dict]:
    """(every answer or refusal, in order; every table shard's state) of one scripted run."""
    service = ParameterServerService(None, 64 << 20)
    parts = [(spec, shard) for spec in TABLES for shard in range(spec.shard_count)]
    for spec, shard in parts:
        service.CreateTable(ps_pb2.CreateTableRequest(spec=spec.to_proto(), shard_index=shard),
                            _Context(0))
    push, pull = request_deserializer("PushManyPacked"), request_deserializer("PullManyPacked")
    rng, answers, context = np.random.default_rng(11), [], _Context(5)

    def call(method, request):
        try:
            answers.append(_encoded(getattr(service, method)(request, context)))
        except _Refused as refused:
            answers.append((refused.code, refused.message))
    for step in range(STEPS):
        for worker in range(WORKERS):
            if step % 4 == 1 and worker == 0:  # refused as a whole, the tables untouched
                call("PushManyPacked", push(_push(rng, step, worker, parts, "nan")))
                call("PushManyPacked", push(_push(rng, step, worker, parts, "foreign")))
            call("PushManyPacked", push(_push(rng, step, worker, parts)))
        ids = [np.unique(_ids(rng, spec, shard)) for spec, shard in parts]
        call("PullManyPacked", pull(PullManyParts([s.name for s, _ in parts],
                                                  [sh for _, sh in parts],
                                                  [step + 1 if s.sync_mode == "sync" else 0
                                                   for s, _ in parts], ids).packed()))
    return answers, {(spec.name, shard): _state(service.shard(spec.name, shard))
                     for spec, shard in parts}


def _encoded(answer) -> bytes:
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


def _state(shard) -> tuple:
    ids, values, slots, step, _ = shard.snapshot()
    return ids.tobytes(), values.tobytes(), {n: s.tobytes() for n, s in slots.items()}, step


@pytest.fixture
def run_on(monkeypatch):
    def run(value: str):
        monkeypatch.setenv(NATIVE_ENV, value)
        assert (native_path.reselect() is None) == (value == "0")
        return _run()
    yield run
    monkeypatch.delenv(NATIVE_ENV)
    native_path.reselect()


def test_steps_answers_and_tables_are_the_same_bytes_on_both_paths(run_on):
    numpy_answers, numpy_tables = run_on("0")
    native_answers, native_tables = run_on("1")
    assert len(native_answers) == len(numpy_answers)
    refusals = [a for a in numpy_answers if isinstance(a, tuple)]
    assert len(refusals) >= 6, refusals  # the spoiled pushes were refused, with reasons
    for i, (mine, theirs) in enumerate(zip(native_answers, numpy_answers)):
        assert mine == theirs, f"answer {i} differs"
    assert native_tables.keys() == numpy_tables.keys()
    for key, state in numpy_tables.items():
        assert native_tables[key] == state, f"{key} differs"
    for (name, _), (*_, step) in numpy_tables.items():  # every good push was applied
        assert step == (STEPS * WORKERS if name == "async" else STEPS), name


def _overflows() -> tuple[list, tuple]:
    """A float16 table pushed past float16's range (its pulls refused OUT_OF_RANGE) and an
    update past float32's (refused, nothing changed): the refusals and the final state."""
    spec = TableSpec("narrow", 4, vocabulary_size=50, num_workers=1, sync_mode="async",
                     optimizer=SGD(1.0), wire_dtype="float16")
    service = ParameterServerService(None, 64 << 20)
    service.CreateTable(ps_pb2.CreateTableRequest(spec=spec.to_proto()), _Context(0))
    push, pull = request_deserializer("PushManyPacked"), request_deserializer("PullManyPacked")
    ids, answers = np.arange(0, 50, 3), []

    def call(method, request):
        try:
            answers.append(_encoded(getattr(service, method)(request, _Context(5))))
        except _Refused as refused:
            answers.append((refused.code, refused.message))
    for step, (scale, lr) in enumerate([(1e4, 0.0), (3e4, 0.0), (3e38, 1e3), (4e4, 0.0)]):
        grads = np.full((len(ids), 4), -scale, np.float32)

        def fill(i, out_ids, out_grads, grads=grads):
            out_ids[...], out_grads[...] = ids, grads
        call("PushManyPacked", push(PushManyParts(
            [(bulk_codec.PushHeader("narrow", 0, step, 0, lr, 0, 1, 0), len(ids), 4,
              np.dtype(np.float32))], fill).packed()))
        call("PullManyPacked", pull(PullManyParts(["narrow"], [0], [0], [ids]).packed()))
    return answers, _state(service.shard("narrow", 0))


def test_overflow_refusals_are_the_same_on_both_paths(monkeypatch):
    runs = []
    for value in ("0", "1"):
        monkeypatch.setenv(NATIVE_ENV, value)
        native_path.reselect()
        runs.append(_overflows())
    monkeypatch.delenv(NATIVE_ENV)
    native_path.reselect()
    (numpy_answers, numpy_state), (native_answers, native_state) = runs
    codes = [a[0].name for a in numpy_answers if isinstance(a, tuple)]
    assert "OUT_OF_RANGE" in codes and "INVALID_ARGUMENT" in codes, numpy_answers
    assert native_answers == numpy_answers
    assert native_state == numpy_state
