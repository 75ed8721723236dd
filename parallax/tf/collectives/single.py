"""One worker (`BACKENDS["single"]`): every collective is the identity."""
from __future__ import annotations

import socket
from typing import Any, Sequence

import tensorflow as tf

from parallax.tf.collectives.workers import WorkerInfo


class SingleWorker:
    """One worker: every collective is the identity."""

    def __init__(self) -> None:
        self.info = WorkerInfo(0, 1, 0, 1, socket.gethostname())

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def local_allgather(self, tensor: tf.Tensor) -> tf.Tensor:
        return tensor

    def allgather_rows(self, tensors: Sequence[Any]) -> list[Any]:
        return list(tensors)

    def broadcast_variables(self, variables: Sequence[tf.Variable]) -> None:
        return None

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj
