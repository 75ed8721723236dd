"""Each worker's share of a dataset batched with the global batch size.

Training (`shard_for_worker`), the contract of MultiWorkerMirroredStrategy's data sharding:
the dataset yields global batches of B; worker r of W gets, for every global batch, its r-th
slice of B/W elements. So step i on W workers sees exactly the elements single-process step
i sees with batch B, which is what makes distributed training comparable with
single-process training. A last, partial global batch is dropped. A dataset already split
by hand among the W workers (a `.shard(W, ...)` in its pipeline, Horovod's habit) is
refused rather than split again (`refuse_split_by_user`).

Evaluation and prediction (`cover_for_worker`): every row counts, so every global batch,
the partial last one included, is split into W contiguous parts in rank order (sizes
differing by one at most, some empty when it has fewer than W rows). The workers still run
the same steps, and their parts, gathered in rank order, are the global batch.
"""
from __future__ import annotations

import contextlib
import logging

import tensorflow as tf

from parallax.errors import ConfigError


def _static_batch_size(dataset: tf.data.Dataset) -> int | None:
    sizes = {spec.shape[0] for spec in tf.nest.flatten(dataset.element_spec)
             if hasattr(spec, "shape") and spec.shape.rank}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def _peeked_batch_size(dataset: tf.data.Dataset) -> int:
    for element in dataset.take(1):
        first = tf.nest.flatten(element)[0]
        return int(tf.shape(first)[0])
    raise ConfigError("the dataset is empty; nothing to distribute")


def global_batch_size(dataset: tf.data.Dataset) -> int:
    return _static_batch_size(dataset) or _peeked_batch_size(dataset)


def _full(batch: int):
    def is_full(*element) -> tf.Tensor:
        return tf.shape(tf.nest.flatten(element)[0])[0] == batch
    return is_full


def _shards_by(dataset: tf.data.Dataset, size: int) -> list[str]:
    """The `.shard(size, index)` steps of `dataset`'s pipeline, as `index` (or '?')."""
    found, seen, stack = [], set(), [dataset]
    while stack:
        step = stack.pop()
        if id(step) in seen:
            continue
        seen.add(id(step))
        if type(step).__name__ == "_ShardDataset" and \
                tf.get_static_value(step._num_shards) == size:  # noqa: SLF001 - tf.data's
            index = tf.get_static_value(step._index)  # noqa: SLF001
            found.append("?" if index is None else str(int(index)))
        try:
            stack.extend(step._inputs())  # noqa: SLF001 - tf.data's own pipeline walk
        except (AttributeError, NotImplementedError):
            continue
    return found


def refuse_split_by_user(dataset: tf.data.Dataset, size: int) -> None:
    """A dataset already split among the workers by hand (Horovod's `.shard(hvd.size(),
    hvd.rank())`) would be split again: each worker would see 1/W of its own part."""
    found = _shards_by(dataset, size) if size > 1 else []
    if found:
        raise ConfigError(
            f"the dataset is already split among the {size} workers (`.shard({size}, "
            f"{found[0]})`, Horovod's habit), and ParallaxStrategy gives each worker its part "
            f"of every global batch itself: each worker would see 1/{size} of its own part. "
            f"Drop the `.shard(...)` and batch with the global batch size (the local batch x "
            f"{size}), or make each worker's part in "
            f"`strategy.distribute_datasets_from_function(fn)`")


def shard_for_worker(dataset: tf.data.Dataset, rank: int, size: int) -> tf.data.Dataset:
    """Rebatch to B/W and keep every W-th mini-batch, starting at `rank`. A last, partial
    global batch is dropped: every worker must run the same steps (a step one worker runs
    alone would wait forever for the others' gradients)."""
    if size == 1:
        return dataset
    refuse_split_by_user(dataset, size)
    batch = global_batch_size(dataset)
    if batch % size:
        raise ConfigError(f"global batch size {batch} is not divisible by the {size} workers;"
                          f" use a multiple of {size} (e.g. {batch - batch % size or size})")
    local = dataset.filter(_full(batch)).rebatch(batch // size)
    return _unsharded(local.shard(size, rank))


def _part(rank: int, size: int):
    def part(*element):
        element = element[0] if len(element) == 1 else element
        rows = tf.shape(tf.nest.flatten(element)[0], out_type=tf.int64)[0]
        lo, hi = rank * rows // size, (rank + 1) * rows // size
        return tf.nest.map_structure(lambda t: t[lo:hi], element)
    return part


def cover_for_worker(dataset: tf.data.Dataset, rank: int, size: int) -> tf.data.Dataset:
    """Rows [r*b//W, (r+1)*b//W) of every global batch of b rows, the partial last one
    included: the W parts, in rank order, are every row once (evaluate, predict)."""
    if size == 1:
        return dataset
    refuse_split_by_user(dataset, size)
    return _unsharded(dataset.map(_part(rank, size)))


class _OurOptionChange(logging.Filter):
    """Drops tf.data's "Changing the value of option auto_shard_policy" record: parallax's
    own change, not the user's (Keras gives the datasets it makes of arrays the DATA
    policy)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("Changing the value of option") and
                    record.args and record.args[0] == "auto_shard_policy")


@contextlib.contextmanager
def _quiet_option_change():
    absl = logging.getLogger("absl")  # tf.data's options log through absl's logger
    quiet = _OurOptionChange()
    absl.addFilter(quiet)
    try:
        yield
    finally:
        absl.removeFilter(quiet)


def _unsharded(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` with tf.data's auto-sharding off: each worker's part is parallax's. tf.data
    logs a warning on every worker when that overrides a policy the dataset had; that one
    line is dropped (`_OurOptionChange`), any other of tf.data's stays."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    with _quiet_option_change():
        return dataset.with_options(options)
