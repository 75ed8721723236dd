"""`DynamicEmbedding`: an embedding keyed by any int64 (or string, hashed to 64 bits in the
graph), whose rows are created when keys are admitted and dropped when evicted, in the
spirit of TF Recommenders-Addons' `dynamic_embedding.keras.layers.Embedding`.

Under a `ParallaxStrategy` the layer's table lives on the parameter servers as a dynamic
table (a keyed table, `TableSpec.hashed_keys`, with admission and eviction): the servers
admit a key after `admit_after` sightings (or with `admit_probability`), bound each shard to
`max_rows_per_shard` rows by evicting LRU or LFU, and drop rows unused for `ttl_steps`. An
unadmitted key reads its default row (the initializer's value for it) and its gradient is
dropped. The worker holds no rows: its `[local_rows, dim]` variable is only a stand-in that
tells the plan the row width, dtype and initializer, and is released when the plan binds
the table.

Outside a strategy the layer trains locally, so a model stays testable on one machine: keys
map exactly (a hash table) to rows of that variable, a key gets a row on its `admit_after`-th
sighting in training while fewer than `local_rows` keys hold one, and other keys read zeros
(no eviction, TTL or admission probability locally).
"""
from __future__ import annotations

import logging
import numbers

import keras
import numpy as np
import tensorflow as tf

from parallax.errors import ConfigError
from parallax.placement.plan import DynamicRows
from parallax.protocol.specs import TableSpec
from parallax.tf.graph.variables import ParallaxVariable

log = logging.getLogger("parallax")

KEY_DTYPES = ("int64", "int32", "string")
_SAVED = ("dynamic_keys", "dynamic_rows", "dynamic_uses")  # a Keras file's rows by key
LOCAL_ROWS = 1 << 16  # rows of the local table (and of the stand-in under a strategy)


def hash_keys(keys: tf.Tensor) -> tf.Tensor:
    """int64 keys of any integer keys (as they are) or strings (FarmHash Fingerprint64, the
    same on every machine and TensorFlow version, so serving hashes alike)."""
    if keys.dtype == tf.string:
        return tf.bitcast(tf.fingerprint(tf.reshape(keys, [-1])), tf.int64)
    return tf.cast(tf.reshape(keys, [-1]), tf.int64)


def dynamic_rows(max_rows_per_shard: int = 0, eviction: str | None = None,
                 admit_after: int = 0, admit_probability: float = 1.0,
                 ttl_steps: int = 0, dim: int = 1) -> DynamicRows:
    """Checked admission and eviction settings (the servers' own checks, `TableSpec`'s);
    `eviction` None: "lru" for a bounded table, "none" for an unbounded one."""
    if eviction is None:
        eviction = "lru" if max_rows_per_shard else "none"
    rows = DynamicRows(max_rows_per_shard=max_rows_per_shard, admit_after=admit_after,
                       admit_probability=admit_probability, eviction=eviction,
                       ttl_steps=ttl_steps)
    TableSpec(name="DynamicEmbedding", dim=dim, **rows.spec_fields())  # raises ConfigError
    return rows


@keras.saving.register_keras_serializable(package="parallax")
class DynamicEmbedding(keras.layers.Layer):
    """Embeddings of `output_dim` for keys of any value; see the module docstring.

    Args:
        output_dim: the width of each row.
        key_dtype: "int64" (or "int32"), or "string" (hashed to int64 in the graph).
        max_rows_per_shard: bound on each server shard's rows (0: unbounded).
        eviction: "lru", "lfu" or "none"; default "lru" when bounded.
        admit_after: sightings before a key gets a row (0 or 1: at once).
        admit_probability: chance per sighting once `admit_after` is reached.
        ttl_steps: evict rows unused for this many steps (0: never).
        embeddings_initializer: a Keras initializer the servers implement (uniform, normal,
            truncated normal, zeros, ones, constant).
        local_rows: rows of the local table outside a strategy.
    """

    def __init__(self, output_dim: int, *, key_dtype: str = "int64",
                 max_rows_per_shard: int = 0, eviction: str | None = None,
                 admit_after: int = 0, admit_probability: float = 1.0, ttl_steps: int = 0,
                 embeddings_initializer="uniform", local_rows: int = LOCAL_ROWS,
                 **kwargs) -> None:
        kwargs["autocast"] = False  # call() reads the variable itself, not a cast copy
        super().__init__(**kwargs)
        if not isinstance(output_dim, int) or isinstance(output_dim, bool) or output_dim < 1:
            raise ConfigError(f"DynamicEmbedding output_dim must be an int >= 1, got "
                              f"{output_dim!r}")
        if key_dtype not in KEY_DTYPES:
            raise ConfigError(f"DynamicEmbedding key_dtype {key_dtype!r} is not supported; "
                              f"use one of {', '.join(KEY_DTYPES)}")
        if not isinstance(local_rows, int) or local_rows < 1:
            raise ConfigError(f"DynamicEmbedding local_rows must be an int >= 1, got "
                              f"{local_rows!r}")
        self.output_dim = output_dim
        self.key_dtype = key_dtype
        self.local_rows = local_rows
        self.rows = dynamic_rows(max_rows_per_shard, eviction, admit_after, admit_probability,
                                 ttl_steps, dim=output_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self._local = None  # the local key -> row tables (outside a strategy)

    def build(self, input_shape=None) -> None:
        self.embeddings = self.add_weight(shape=(self.local_rows, self.output_dim),
                                          initializer=self.embeddings_initializer,
                                          name="embeddings", trainable=True)
        var = self._variable
        if isinstance(var, ParallaxVariable) and var.parallax_planned:
            raise ConfigError(
                f"DynamicEmbedding {self.name!r} was built after its ParallaxStrategy made "
                f"its plan (at the first training step), so its table can no longer be "
                f"placed on the servers; build every DynamicEmbedding before the first step, "
                f"or build and train this model in a ParallaxStrategy of its own")
        var.dynamic_rows = self.rows
        var.dynamic_initializer = self.embeddings_initializer
        if not isinstance(var, ParallaxVariable):
            self._local = _LocalKeys(self, self.local_rows)
        self.built = True

    @property
    def _variable(self) -> tf.Variable:
        return getattr(self.embeddings, "value", self.embeddings)

    def call(self, keys, training=None):
        if isinstance(keys, (tf.RaggedTensor, tf.SparseTensor)):
            raise ConfigError(f"DynamicEmbedding {self.name!r} takes dense keys, got a "
                              f"{type(keys).__name__}; pad it (.to_tensor() / "
                              f"tf.sparse.to_dense) and mask the padding downstream")
        keys = tf.convert_to_tensor(keys)
        self._check_keys(keys.dtype)
        flat = hash_keys(keys)
        var = self._variable
        if self._local is not None:
            rows = self._local.rows(flat, bool(training))
        elif var.remote is not None:
            rows = var.sparse_read(flat)  # the servers' rows of these keys
        else:  # a ParallaxVariable before the plan moved it: a stand-in read, same shape
            rows = var.sparse_read(tf.math.floormod(flat, self.local_rows))
        shape = tf.concat([tf.shape(keys), [self.output_dim]], axis=0)
        return tf.reshape(tf.cast(rows, self.compute_dtype), shape)

    def _check_keys(self, dtype: tf.DType) -> None:
        if (dtype == tf.string) != (self.key_dtype == "string") or \
                not (dtype == tf.string or dtype.is_integer):
            raise ConfigError(f"DynamicEmbedding {self.name!r} takes {self.key_dtype} keys, "
                              f"got {dtype.name}; set key_dtype to match the input (floats: "
                              f"cast to int64 yourself, if they are whole numbers)")

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(output_dim=self.output_dim, key_dtype=self.key_dtype,
                      max_rows_per_shard=self.rows.max_rows_per_shard,
                      eviction=self.rows.eviction, admit_after=self.rows.admit_after,
                      admit_probability=self.rows.admit_probability,
                      ttl_steps=self.rows.ttl_steps, local_rows=self.local_rows,
                      embeddings_initializer=keras.initializers.serialize(
                          self.embeddings_initializer))
        return config

    # ---- Keras files: the local tables travel with the rows ----

    def save_own_variables(self, store) -> None:
        """The file holds the rows by key (from the servers under a strategy), so it loads
        with plain Keras: `load_own_variables` puts them into the local table."""
        super().save_own_variables(store)
        held = self._local is not None or self._variable.remote is not None
        keys, rows, uses = self.export_rows() if held else (
            np.zeros(0, np.int64), np.zeros((0, self.output_dim), np.float32),
            np.zeros(0, np.int64))
        store[_SAVED[0]], store[_SAVED[1]], store[_SAVED[2]] = keys, rows, uses

    def load_own_variables(self, store) -> None:
        """Locally: the file's rows by key (the most used `local_rows` of them). Under a
        strategy the servers' checkpoint, which the file refers to, holds the table."""
        names = [str(k) for k in store.keys()]
        super().load_own_variables({k: store[k] for k in names if k not in _SAVED})
        if self._local is not None and _SAVED[0] in names:
            self._local.adopt(*(np.asarray(store[k]) for k in _SAVED))

    # ---- export ----

    def export_rows(self, keys=None, top_n: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys int64 [n], rows [n, output_dim], uses int64 [n]) of the rows the table
        holds: those of `keys` (raw keys: strings are hashed), the `top_n` most used, or
        all. Eager, between steps."""
        wanted = None
        if keys is not None:
            keys = tf.constant(keys)
            self._check_keys(keys.dtype)
            wanted = hash_keys(keys).numpy()
        if top_n is not None and (not isinstance(top_n, numbers.Integral) or top_n < 1):
            raise ConfigError(f"top_n must be an int >= 1, got {top_n!r}")
        top_n = None if top_n is None else int(top_n)
        if not self.built:
            raise ConfigError(f"DynamicEmbedding {self.name!r} is not built yet: call it "
                              f"(train) before exporting its rows")
        if self._local is not None:
            return self._local.export(wanted, top_n)
        remote = self._variable.remote
        if remote is None:
            raise ConfigError(f"DynamicEmbedding {self.name!r} has no rows yet: the "
                              f"strategy places its table at the first training step")
        remote.land_pushes()
        found, rows, uses = remote.table.export_rows(keys=wanted, top_n=top_n)
        return found, rows.reshape(len(found), self.output_dim), uses

    def serving_layer(self, keys=None, top_n: int | None = None,
                      name: str | None = None) -> "ServingEmbedding":
        """A plain Keras layer holding the exported rows (`export_rows`) in a static lookup,
        to build a model that serves (SavedModel) without parallax or its servers; keys it
        does not hold read zeros."""
        found, rows, _ = self.export_rows(keys, top_n)
        return ServingEmbedding(found, rows, key_dtype=self.key_dtype,
                                name=name or self.name)


class _LocalKeys(tf.Module):
    """The local table outside a strategy: key -> row of the layer's variable (a hash
    table), sightings per key, and the next free row. A tf.Module, so a SavedModel of a
    locally trained model tracks (and holds) its tables."""

    def __init__(self, layer: DynamicEmbedding, capacity: int) -> None:
        super().__init__(name="dynamic_keys")
        self.layer = layer
        self.capacity = capacity
        self.index = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1,
                                                             name="dynamic_index")
        self.uses = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, 0,
                                                            name="dynamic_uses")
        self.next_row = tf.Variable(0, dtype=tf.int64, trainable=False, name="next_row")

    def rows(self, keys: tf.Tensor, training: bool) -> tf.Tensor:
        unique, inverse = tf.unique(keys, out_idx=tf.int32)
        if training:
            index = tf.reshape(self.index.lookup(unique), [-1])
            # sightings: of held keys (their use counts), and of others while a row is free
            counted = (index >= 0) | (self.next_row < self.capacity)
            seen = tf.boolean_mask(unique, counted)
            uses = tf.reshape(self.uses.lookup(seen), [-1]) + 1
            self.uses.insert(seen, uses)
            self._admit(seen, tf.boolean_mask(index, counted), uses)
        index = tf.reshape(self.index.lookup(unique), [-1])
        held = tf.where(index >= 0)[:, 0]
        var = self.layer._variable
        found = tf.gather(var, tf.gather(index, held))  # gradients reach held rows only
        rows = tf.scatter_nd(held[:, None], found,
                             tf.stack([tf.size(unique, tf.int64),
                                       tf.constant(self.layer.output_dim, tf.int64)]))
        return tf.gather(rows, inverse)

    def _admit(self, unique: tf.Tensor, index: tf.Tensor, uses: tf.Tensor) -> None:
        admit_after = max(1, self.layer.rows.admit_after)
        new = tf.boolean_mask(unique, (index < 0) & (uses >= admit_after))
        room = tf.maximum(tf.constant(self.capacity, tf.int64) - self.next_row, 0)
        new = new[:tf.minimum(tf.size(new, tf.int64), room)]
        first = self.next_row.read_value()
        self.index.insert(new, first + tf.range(tf.size(new, tf.int64), dtype=tf.int64))
        self.next_row.assign_add(tf.size(new, tf.int64))

    def adopt(self, keys: np.ndarray, rows: np.ndarray, uses: np.ndarray) -> None:
        """Hold exactly these rows (a Keras file's): the `capacity` most used, if more."""
        if len(keys) > self.capacity:
            log.warning("DynamicEmbedding %r: the file holds %d rows, local_rows is %d: the "
                        "%d most used are kept (raise local_rows to keep all)",
                        self.layer.name, len(keys), self.capacity, self.capacity)
            best = np.lexsort((keys, -uses))[:self.capacity]
            keys, rows, uses = keys[best], rows[best], uses[best]
        for table in (self.index, self.uses):
            table.remove(table.export()[0])
        keys = tf.constant(keys, tf.int64)
        self.index.insert(keys, tf.range(tf.size(keys, tf.int64), dtype=tf.int64))
        self.uses.insert(keys, tf.constant(uses, tf.int64))
        var = self.layer._variable
        var.scatter_update(tf.IndexedSlices(tf.constant(rows, var.dtype),
                                            tf.range(tf.size(keys, tf.int64))))
        self.next_row.assign(len(rows))

    def export(self, wanted, top_n) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        keys, rows_at = (t.numpy() for t in self.index.export())
        order = np.argsort(keys, kind="stable")
        keys, rows_at = keys[order], rows_at[order]
        uses = self.uses.lookup(tf.constant(keys, tf.int64)).numpy()
        if wanted is not None:
            keep = np.isin(keys, wanted)
            keys, rows_at, uses = keys[keep], rows_at[keep], uses[keep]
        if top_n is not None:
            best = np.lexsort((keys, -uses))[:top_n]
            keys, rows_at, uses = keys[best], rows_at[best], uses[best]
        values = self.layer._variable.numpy()[rows_at]
        return keys, values, uses


class ServingEmbedding(keras.layers.Layer):
    """Exported rows of a `DynamicEmbedding` in a static hash table: serves anywhere
    TensorFlow runs (no parallax at load time); keys it does not hold read zeros."""

    def __init__(self, keys, rows, *, key_dtype: str = "int64", **kwargs) -> None:
        super().__init__(**kwargs)
        keys = np.asarray(keys, np.int64).reshape(-1)
        rows = np.asarray(rows, np.float32)
        if rows.ndim != 2 or len(rows) != len(keys):
            raise ConfigError(f"ServingEmbedding needs one row per key: {len(keys)} keys, "
                              f"rows of shape {rows.shape}")
        self.key_dtype = key_dtype
        self.output_dim = rows.shape[1]
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(keys, tf.int64),
                                                tf.range(len(keys), dtype=tf.int64)),
            default_value=len(keys))
        padded = np.concatenate([rows, np.zeros((1, self.output_dim), np.float32)])
        self.rows = tf.constant(padded)

    def call(self, keys):
        keys = tf.convert_to_tensor(keys)
        found = tf.gather(self.rows, self.table.lookup(hash_keys(keys)))
        return tf.reshape(tf.cast(found, self.compute_dtype),
                          tf.concat([tf.shape(keys), [self.output_dim]], axis=0))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self) -> dict:
        raise ConfigError(f"ServingEmbedding {self.name!r} holds its rows as constants of the "
                          f"graph, not as a Keras config: export the serving model as a "
                          f"SavedModel (model.export(path) or tf.saved_model.save)")
