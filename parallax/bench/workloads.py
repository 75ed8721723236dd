"""The benchmark workloads: their sizes and synthetic data, identical under every system
compared (TensorFlow-free: the command line and the harness read them; the models that train
on them are in `parallax.bench.models`).

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

from parallax.errors import ConfigError
from parallax.placement.traffic_model import Workload

WORKLOADS = ("lm", "ctr", "dense")
SIZES = ("full", "short")
ZIPF_A = 1.1
POOL_BATCHES = 16  # batches per worker made before timing and cycled: losses repeat with it


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
    data_batches: int = POOL_BATCHES  # batches per worker made before timing, then cycled

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


def batch_pool(spec: WorkloadSpec, rank: int,
               batches: int | None = None) -> list[dict[str, np.ndarray]]:
    """A few batches made before timing starts and cycled, so data generation costs the
    same (nothing) under every system."""
    count = spec.data_batches if batches is None else batches
    return [local_batch(spec, rank, i) for i in range(count)]


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
