"""The benchmark models and their synthetic data, identical under every system compared.

The models are plain `tf.Module`s built from `tf.Variable`s, `tf.nn.embedding_lookup` and
matmuls, not Keras layers: every peer must see the same graph, and under TensorFlow's
ParameterServerStrategy a Keras 3 Embedding would first read its whole (sharded) table to
the worker, where `embedding_lookup` gathers on the servers. Initial values come from
stateless seeded draws, so every worker starts from the same weights without a broadcast.

Workloads (full size; `short` is the CI configuration, same shapes, tiny sizes):
- lm: a next-word model in the shape of LM1B in the Parallax paper: a 500k-word input table
  read by an 8-word context, a small dense core (two layers), and a 500k-word output
  embedding scored against the batch's targets plus shared sampled negatives (sparse: only
  those rows are read). Ids are Zipf-distributed like word frequencies.
- ctr: DLRM-style click-through model in the shape of Criteo: 26 categorical tables,
  10.3M rows in all, dim 16, Zipf-distributed ids, 13 dense features, bottom and top MLPs.
- dense: an MLP with no embeddings (the all-reduce case).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from parallax.errors import ConfigError
from parallax.traffic_model import Workload

WORKLOADS = ("lm", "ctr", "dense")
SIZES = ("full", "short")
ZIPF_A = 1.1


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of one benchmark model and of its per-worker batch."""

    name: str
    size: str
    batch_per_worker: int
    table_rows: tuple[int, ...] = ()
    table_dim: int = 0
    context: int = 0            # lm: words of context per example
    negatives: int = 0          # lm: sampled negatives shared by the batch
    dense_features: int = 0     # ctr: numeric features
    hidden: tuple[int, ...] = ()
    outputs: int = 1            # dense: classes
    lr: float = 0.05
    seed: int = 1234
    ids_per_example: tuple[int, ...] = field(default=())  # per table: ids one example reads

    @property
    def table_bytes(self) -> int:
        return sum(rows * self.table_dim * 4 for rows in self.table_rows)


def _ctr_rows(scale: float) -> tuple[int, ...]:
    """26 tables whose sizes fall geometrically, like Criteo's (a few huge, many small)."""
    return tuple(max(10, int(3_100_000 * scale * 0.7 ** i)) for i in range(26))


def get(name: str, size: str = "full") -> WorkloadSpec:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    if size not in SIZES:
        raise ConfigError(f"unknown workload size {size!r}: choose one of {', '.join(SIZES)}")
    full = size == "full"
    if name == "lm":
        vocab = 500_000 if full else 20_000
        return WorkloadSpec("lm", size, batch_per_worker=256 if full else 32,
                            table_rows=(vocab, vocab), table_dim=64, context=8,
                            negatives=512 if full else 64, hidden=(256,) if full else (32,),
                            ids_per_example=(8, 1))
    if name == "ctr":
        rows = _ctr_rows(1.0 if full else 1 / 500)
        return WorkloadSpec("ctr", size, batch_per_worker=256 if full else 32, table_rows=rows,
                            table_dim=16, dense_features=13,
                            hidden=(64, 256, 128) if full else (16, 32, 16),
                            ids_per_example=(1,) * 26)
    return WorkloadSpec("dense", size, batch_per_worker=128 if full else 16,
                        dense_features=256 if full else 32,
                        hidden=(1024, 1024, 1024) if full else (64, 64), outputs=10)


def _init(shape: tuple[int, ...], seed: int, scale: float) -> tf.Tensor:
    return tf.random.stateless_uniform(shape, seed=(seed, 0), minval=-scale, maxval=scale)


def _variable(shape: tuple[int, ...], seed: int, name: str, scale: float | None = None):
    scale = (6.0 / sum(shape[-2:])) ** 0.5 if scale is None else scale  # Glorot for matrices
    return tf.Variable(lambda: _init(shape, seed, scale), name=name)


class _Mlp(tf.Module):
    def __init__(self, sizes: tuple[int, ...], seed: int, name: str) -> None:
        super().__init__(name=name)
        self.kernels = [_variable((a, b), seed + i, f"{name}_kernel_{i}")
                        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
        self.biases = [tf.Variable(tf.zeros([b]), name=f"{name}_bias_{i}")
                       for i, b in enumerate(sizes[1:])]

    def __call__(self, x: tf.Tensor, last_activation: bool = False) -> tf.Tensor:
        for i, (kernel, bias) in enumerate(zip(self.kernels, self.biases)):
            x = tf.matmul(x, kernel) + bias
            if i < len(self.kernels) - 1 or last_activation:
                x = tf.nn.relu(x)
        return x


class BenchModel(tf.Module):
    """One of the three models; `loss(batch)` is the mean loss over a local batch."""

    def __init__(self, spec: WorkloadSpec) -> None:
        super().__init__(name=spec.name)
        self.spec = spec
        d = spec.table_dim
        self.tables = [_variable((rows, d), spec.seed + 100 + t, f"table_{t}", scale=0.05)
                       for t, rows in enumerate(spec.table_rows)]
        if spec.name == "lm":
            self.core = _Mlp((spec.context * d, *spec.hidden, d), spec.seed, "core")
        elif spec.name == "ctr":
            bottom = (spec.dense_features, spec.hidden[0], d)
            self.bottom = _Mlp(bottom, spec.seed, "bottom")
            self.top = _Mlp(((len(spec.table_rows) + 1) * d, *spec.hidden[1:], 1),
                            spec.seed + 50, "top")
        else:
            self.mlp = _Mlp((spec.dense_features, *spec.hidden, spec.outputs), spec.seed, "mlp")

    def loss(self, batch: dict[str, tf.Tensor]) -> tf.Tensor:
        name = self.spec.name
        if name == "lm":
            return self._lm_loss(batch)
        if name == "ctr":
            return self._ctr_loss(batch)
        logits = self.mlp(batch["features"])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=batch["labels"], logits=logits))

    def _lm_loss(self, batch: dict[str, tf.Tensor]) -> tf.Tensor:
        context = tf.nn.embedding_lookup(self.tables[0], batch["context"])   # [b, c, d]
        h = self.core(tf.reshape(context, [-1, self.spec.context * self.spec.table_dim]))
        candidates = tf.concat([batch["targets"], batch["negatives"]], axis=0)
        scored = tf.nn.embedding_lookup(self.tables[1], candidates)          # [b + k, d]
        logits = tf.matmul(h, scored, transpose_b=True)                      # [b, b + k]
        labels = tf.range(tf.shape(h)[0])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))

    def _ctr_loss(self, batch: dict[str, tf.Tensor]) -> tf.Tensor:
        ids = tf.unstack(batch["ids"], axis=1)                               # 26 x [b]
        embedded = [tf.nn.embedding_lookup(t, i) for t, i in zip(self.tables, ids)]
        x = tf.concat([self.bottom(batch["dense"], last_activation=True), *embedded], axis=1)
        logits = tf.squeeze(self.top(x), axis=1)
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=batch["labels"], logits=logits))


def _zipf_ids(rng: np.random.Generator, rows: int, shape) -> np.ndarray:
    return ((rng.zipf(ZIPF_A, size=shape) - 1) % rows).astype(np.int64)


def local_batch(spec: WorkloadSpec, rank: int, index: int) -> dict[str, np.ndarray]:
    """Worker `rank`'s batch number `index`: deterministic, so every system sees the same data."""
    rng = np.random.default_rng([spec.seed, rank, index])
    b = spec.batch_per_worker
    if spec.name == "lm":
        vocab = spec.table_rows[0]
        return {"context": _zipf_ids(rng, vocab, (b, spec.context)),
                "targets": _zipf_ids(rng, vocab, (b,)),
                "negatives": rng.integers(0, vocab, size=spec.negatives, dtype=np.int64)}
    if spec.name == "ctr":
        ids = np.stack([_zipf_ids(rng, rows, (b,)) for rows in spec.table_rows], axis=1)
        return {"ids": ids, "dense": rng.standard_normal((b, spec.dense_features), np.float32),
                "labels": (rng.random(b) < 0.25).astype(np.float32)}
    return {"features": rng.standard_normal((b, spec.dense_features), np.float32),
            "labels": rng.integers(0, spec.outputs, size=b, dtype=np.int64)}


def batch_pool(spec: WorkloadSpec, rank: int, batches: int = 16) -> list[dict[str, np.ndarray]]:
    """A few batches made before timing starts and cycled, so data generation costs the
    same (nothing) under every system."""
    return [local_batch(spec, rank, i) for i in range(batches)]


def dataset(spec: WorkloadSpec, rank: int, batches: int = 16) -> tf.data.Dataset:
    pool = batch_pool(spec, rank, batches)
    stacked = {key: np.stack([b[key] for b in pool]) for key in pool[0]}
    return tf.data.Dataset.from_tensor_slices(stacked).repeat().prefetch(2)


def unique_rows_per_step(spec: WorkloadSpec, batches: int = 8) -> tuple[int, ...]:
    """Mean unique rows per table one worker's batch touches (for the traffic model)."""
    counts = np.zeros(len(spec.table_rows))
    for i in range(batches):
        batch = local_batch(spec, 0, i)
        if spec.name == "lm":
            per_table = [batch["context"], np.concatenate([batch["targets"], batch["negatives"]])]
        else:
            per_table = [batch["ids"][:, t] for t in range(len(spec.table_rows))]
        counts += [np.unique(ids).size for ids in per_table]
    return tuple(int(round(c / batches)) for c in counts)


def dense_bytes(spec: WorkloadSpec) -> int:
    """Bytes of the model's dense (non-table) variables, computed without building it."""
    if spec.name == "lm":
        sizes = (spec.context * spec.table_dim, *spec.hidden, spec.table_dim)
        return _mlp_bytes(sizes)
    if spec.name == "ctr":
        return (_mlp_bytes((spec.dense_features, spec.hidden[0], spec.table_dim))
                + _mlp_bytes(((len(spec.table_rows) + 1) * spec.table_dim, *spec.hidden[1:], 1)))
    return _mlp_bytes((spec.dense_features, *spec.hidden, spec.outputs))


def _mlp_bytes(sizes: tuple[int, ...]) -> int:
    return 4 * sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def traffic_workload(spec: WorkloadSpec, workers: int) -> Workload:
    """The traffic model's view of this workload on `workers` workers."""
    return Workload(workers=workers, dense_bytes=dense_bytes(spec),
                    table_rows=spec.table_rows,
                    table_dims=(spec.table_dim,) * len(spec.table_rows),
                    unique_rows=unique_rows_per_step(spec) if spec.table_rows else ())
