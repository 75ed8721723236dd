"""The analytic data-transfer model: the bytes a worker must send and receive per step under
each way of training, against which measured traffic is compared (Parallax, EuroSys'19, §3).

Per worker, per step, for W workers:
- sparse table on parameter servers: pull the unique rows the batch touches, push their
  gradients: U x row bytes each way (ids ride along: 8 bytes per row each way);
- dense variables by ring all-reduce: 2 (W-1)/W x dense bytes sent, and as many received;
- dense variables on parameter servers: pull all, push all: dense bytes each way;
- sparse gradients all-gathered (Horovod on IndexedSlices): a worker receives the other
  W-1 workers' rows (values and int64 indices) and, in a ring, forwards as many;
- sparse gradients densified (Horovod `sparse_as_dense=True`): the whole table all-reduced.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax.errors import ConfigError

ID_BYTES = 8  # int64 row ids travel with pulled rows and pushed gradients


@dataclass(frozen=True)
class StepTraffic:
    """Bytes one worker sends and receives in one training step."""

    sent: float
    received: float

    def __add__(self, other: "StepTraffic") -> "StepTraffic":
        return StepTraffic(self.sent + other.sent, self.received + other.received)

    @property
    def total(self) -> float:
        return self.sent + self.received


@dataclass(frozen=True)
class Workload:
    """What the model moves: per table, the unique rows a worker's batch touches."""

    workers: int
    dense_bytes: int
    table_rows: tuple[int, ...] = ()       # rows of each sparse table
    table_dims: tuple[int, ...] = ()       # dim of each sparse table
    unique_rows: tuple[int, ...] = ()      # unique rows per worker per step, per table
    itemsize: int = 4

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if not len(self.table_rows) == len(self.table_dims) == len(self.unique_rows):
            raise ConfigError(f"table_rows, table_dims and unique_rows must have one entry "
                              f"per table, got {len(self.table_rows)}, "
                              f"{len(self.table_dims)}, {len(self.unique_rows)}")
        for rows, unique in zip(self.table_rows, self.unique_rows):
            if not 0 <= unique <= rows:
                raise ConfigError(f"unique rows per step {unique} must be in [0, {rows}]")

    def row_bytes(self, table: int) -> int:
        return self.table_dims[table] * self.itemsize


def sparse_on_servers(workload: Workload) -> StepTraffic:
    pull_push = sum(u * (workload.row_bytes(t) + ID_BYTES)
                    for t, u in enumerate(workload.unique_rows))
    return StepTraffic(sent=pull_push, received=pull_push)


def ring_allreduce(nbytes: float, workers: int) -> StepTraffic:
    each = 2 * (workers - 1) / workers * nbytes
    return StepTraffic(sent=each, received=each)


def dense_on_servers(nbytes: float) -> StepTraffic:
    return StepTraffic(sent=nbytes, received=nbytes)


def sparse_allgathered(workload: Workload) -> StepTraffic:
    """Ring all-gather of every worker's (values, indices): each worker forwards and
    receives W-1 workers' shares."""
    share = sum(u * (workload.row_bytes(t) + ID_BYTES) for t, u in enumerate(workload.unique_rows))
    each = (workload.workers - 1) * share
    return StepTraffic(sent=each, received=each)


def table_bytes(workload: Workload) -> int:
    return sum(rows * workload.row_bytes(t) for t, rows in enumerate(workload.table_rows))


def expected_traffic(system: str, workload: Workload) -> StepTraffic:
    """Per worker per step for: hybrid, ps, allreduce (parallax's modes, the last also
    Horovod on IndexedSlices), horovod_sparse_as_dense, and mwms (TensorFlow's
    MultiWorkerMirroredStrategy all-gathers IndexedSlices gradients too: measured in
    docs/benchmarks.md, it moves what Horovod's all-gather does, not a densified table)."""
    w = workload.workers
    if system == "hybrid":
        return sparse_on_servers(workload) + ring_allreduce(workload.dense_bytes, w)
    if system == "ps":
        return sparse_on_servers(workload) + dense_on_servers(workload.dense_bytes)
    if system in ("allreduce", "mwms"):
        return sparse_allgathered(workload) + ring_allreduce(workload.dense_bytes, w)
    if system == "horovod_sparse_as_dense":
        return ring_allreduce(workload.dense_bytes + table_bytes(workload), w)
    raise ConfigError(f"system {system!r} is not one of hybrid, ps, allreduce, "
                      f"horovod_sparse_as_dense, mwms")
