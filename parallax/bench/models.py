"""The benchmark models (`parallax.bench.workloads` has their sizes and data).

The models are plain `tf.Module`s built from `tf.Variable`s, `tf.nn.embedding_lookup` and
matmuls, not Keras layers: every peer must see the same graph, and under TensorFlow's
ParameterServerStrategy a Keras 3 Embedding would first read its whole (sharded) table to
the worker, where `embedding_lookup` gathers on the servers. Initial values come from
stateless seeded draws, so every worker starts from the same weights without a broadcast.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from parallax.bench.workloads import WorkloadSpec, batch_pool


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


def dataset(spec: WorkloadSpec, rank: int, batches: int | None = None) -> tf.data.Dataset:
    """Worker `rank`'s batches, cycled: `spec.data_batches` of them unless `batches`."""
    pool = batch_pool(spec, rank, batches)
    stacked = {key: np.stack([b[key] for b in pool]) for key in pool[0]}
    return tf.data.Dataset.from_tensor_slices(stacked).repeat().prefetch(2)


def train_fn(model, optimizer, scale: float):
    """The per-replica step shared by the strategies: loss scaled by 1/replicas because
    tf.distribute sums gradients across replicas (the Keras and MWMS convention)."""
    def step_fn(batch):
        with tf.GradientTape() as tape:
            loss = model.loss(batch)
            scaled = loss * scale
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step_fn
