"""Horovod's ring all-reduce (`BACKENDS["horovod"]`), for workers horovodrun or mpirun
started (gloo or MPI)."""
from __future__ import annotations

import os
import re
import socket
from typing import Any, Sequence

import tensorflow as tf

from parallax.env import HOROVOD_AUTOTUNE_ENV, HOROVOD_CYCLE_TIME_ENV, WORKER_CYCLE_TIME_MS
from parallax.errors import ConfigError
from parallax.tf.collectives.workers import WorkerInfo

_HOROVOD_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# Horovod's background thread runs one coordination round among all workers every cycle,
# with or without tensors to reduce: at its default 1 ms cycle, four idle workers on this
# machine's two cores burned 150-370 ms of CPU per second each (`HOROVOD_CYCLE_TIME=50`:
# 14-17). A worker waiting for the parameter servers pays it. parallax submits a step's dense
# gradients as one group, so a longer cycle costs one cycle of latency at most per traced
# step's all-reduce (and per other collective: plan checks, barriers), not fusion. Used
# unless HOROVOD_CYCLE_TIME is set (horovodrun --cycle-time-ms sets it), Horovod's autotuner
# is on (a cycle time from the environment is fixed, never tuned), or hvd.init() ran already.
# (parallax.env.WORKER_CYCLE_TIME_MS: 5 ms, Horovod's own default before 0.21)
# Variables of at most this many bytes in all are broadcast as one pickled object
# (`HorovodWorkers.broadcast_variables`); more go through Horovod's broadcast_variables.
OBJECT_BROADCAST_BYTES = 32 << 20


class HorovodWorkers:
    """Horovod (gloo or MPI) peers. Dense gradients are reduced with one grouped all-reduce,
    which Horovod fuses into large buffers; IndexedSlices are all-gathered."""

    def __init__(self) -> None:
        try:
            import horovod.tensorflow as hvd
        except ImportError as exc:
            raise ConfigError(f"this worker was launched by horovodrun/mpirun but Horovod "
                              f"cannot be imported ({exc}); install it as docs/install.md says "
                              f"(or `make env`)") from None
        self.hvd = hvd
        if not hvd.is_initialized() and not _autotuned(os.environ):
            os.environ.setdefault(HOROVOD_CYCLE_TIME_ENV, str(WORKER_CYCLE_TIME_MS))
        hvd.init()
        self.info = WorkerInfo(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                               socket.gethostname())
        self._local_set = None

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        if not tensors:
            return []
        return list(self.hvd.grouped_allreduce(list(tensors), op=self.hvd.Sum,
                                               name="parallax_dense"))

    def allgather_rows(self, tensors: Sequence[Any]) -> list[Any]:
        """Concatenate each tensor along axis 0 over every worker, in rank order (row counts
        may differ, zero included)."""
        return [self.hvd.allgather(tf.convert_to_tensor(t)) for t in tensors]

    def local_allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        """Concatenate `tensor` over the workers of this host (local aggregation)."""
        if self.info.local_size == self.info.size:
            return self.hvd.allgather(tensor)
        raise ConfigError("local aggregation across several hosts needs Horovod process sets "
                          "per host, which parallax does not create yet; run without "
                          "local_aggregation")

    def broadcast_variables(self, variables: Sequence[tf.Variable]) -> None:
        """Every variable takes rank 0's value, bit for bit. Horovod's broadcast_variables
        traces a tf.function of one broadcast per variable at each call: 0.15 s of CPU (0.25-0.3
        s) on a 2-core machine for a handful of dense weights, in the first step of every job
        and restart. Up to OBJECT_BROADCAST_BYTES of numeric variables (the same on every
        worker: the same model) go instead as one pickled object, two eager broadcasts
        (0.03 s of CPU)."""
        variables = list(variables)
        if not variables:
            return
        if not _small_and_numeric(variables):
            self.hvd.broadcast_variables(variables, root_rank=0)
            return
        values = self.hvd.broadcast_object([v.numpy() for v in variables]
                                           if self.info.is_chief else None,
                                           root_rank=0, name="parallax_replicated")
        for variable, value in zip(variables, values):
            variable.assign(value)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self.hvd.allgather_object(obj))

    def broadcast_object(self, obj: Any) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=0)


def _small_and_numeric(variables: Sequence[tf.Variable]) -> bool:
    """Whether `variables` have known shapes, numeric dtypes and OBJECT_BROADCAST_BYTES or
    fewer in all."""
    total = 0
    for variable in variables:
        dtype, count = variable.dtype, variable.shape.num_elements()
        if count is None or not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
            return False
        total += count * dtype.size
    return total <= OBJECT_BROADCAST_BYTES


def _autotuned(environ) -> bool:
    """Whether Horovod's autotuner is on: HOROVOD_AUTOTUNE read as C's strtol, > 0."""
    digits = re.match(r"\s*[+-]?\d+", environ.get(HOROVOD_AUTOTUNE_ENV, ""))
    return digits is not None and int(digits[0]) > 0


def launched_by_horovod(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return any(name in environ for name in _HOROVOD_ENV)
