"""Typed, validated specs of tables, initializers and server-side optimizers.

One dataclass per concept, each with `to_proto`/`from_proto`; client and server both validate
through these, so a bad spec fails the same way on either side with a message naming the field.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import ClassVar, Sequence, Union, get_args

import numpy as np

from parallax.errors import ConfigError
from parallax.protocol import wire, wire_dtypes
from parallax.ps.v1 import ps_pb2

_TABLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_INIT_KINDS = {
    "zeros": ps_pb2.InitializerSpec.ZEROS,
    "constant": ps_pb2.InitializerSpec.CONSTANT,
    "uniform": ps_pb2.InitializerSpec.RANDOM_UNIFORM,
    "normal": ps_pb2.InitializerSpec.RANDOM_NORMAL,
    "truncated_normal": ps_pb2.InitializerSpec.TRUNCATED_NORMAL,
}
_PARTITIONS = {"mod": ps_pb2.MOD, "range": ps_pb2.RANGE}
_SYNC_MODES = {"sync": ps_pb2.SYNC, "async": ps_pb2.ASYNC}
_AGGREGATIONS = {"sum": ps_pb2.SUM, "mean": ps_pb2.MEAN}


def _lookup(table: dict, value: object, what: str) -> object:
    if value not in table:
        raise ConfigError(f"{what} {value!r} is not supported; use one of {sorted(table)}")
    return table[value]


def _reverse(table: dict, code: int, what: str) -> str:
    for name, c in table.items():
        if c == code:
            return name
    raise ConfigError(f"{what} code {code} is unset or unknown; use one of {sorted(table)}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class Initializer:
    """Initial row values; random kinds are a pure function of (seed, row id, column)."""

    kind: str = "zeros"
    value: float = 0.0
    minval: float = -0.05
    maxval: float = 0.05
    mean: float = 0.0
    stddev: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        _lookup(_INIT_KINDS, self.kind, "initializer kind")
        for name in ("value", "minval", "maxval", "mean", "stddev"):
            number = getattr(self, name)
            _require(math.isfinite(number), f"initializer {name} must be a finite number, got "
                     f"{number}; NaN/Inf initial values are refused")
        _require(self.kind != "uniform" or self.minval < self.maxval,
                 f"uniform initializer needs minval < maxval, got [{self.minval}, {self.maxval})")
        _require(self.stddev >= 0, f"initializer stddev must be >= 0, got {self.stddev}")
        _require(0 <= self.seed < 2**64, f"initializer seed must be in [0, 2**64), got {self.seed}")

    def largest(self) -> float:
        """The largest magnitude an initial value (or, for uniform, the width it is drawn
        from, in float64) can take; normal draws stay within 8.6 standard deviations, as they
        come from 53-bit uniforms."""
        reach = {"zeros": 0.0, "constant": abs(self.value),
                 "uniform": max(abs(self.minval), abs(self.maxval), self.maxval - self.minval),
                 "normal": abs(self.mean) + 8.6 * self.stddev,
                 "truncated_normal": abs(self.mean) + 2.0 * self.stddev}
        return reach[self.kind]

    def to_proto(self) -> ps_pb2.InitializerSpec:
        return ps_pb2.InitializerSpec(
            kind=_INIT_KINDS[self.kind], value=self.value, minval=self.minval,
            maxval=self.maxval, mean=self.mean, stddev=self.stddev, seed=self.seed)

    @classmethod
    def from_proto(cls, msg: ps_pb2.InitializerSpec) -> "Initializer":
        return cls(kind=_reverse(_INIT_KINDS, msg.kind, "initializer kind"), value=msg.value,
                   minval=msg.minval, maxval=msg.maxval, mean=msg.mean, stddev=msg.stddev,
                   seed=msg.seed)


@dataclass(frozen=True)
class SGD:
    """Keras 3 `SGD`: plain, momentum, or Nesterov momentum."""

    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    kind: ClassVar[str] = "sgd"
    counts_steps: ClassVar[bool] = False  # a row's update: its value, slots and gradient

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        _require(0 <= self.momentum <= 1, f"SGD momentum must be in [0, 1], got {self.momentum}")

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum != 0 else ()


@dataclass(frozen=True)
class Adagrad:
    """Keras 3 `Adagrad`."""

    learning_rate: float = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    kind: ClassVar[str] = "adagrad"
    counts_steps: ClassVar[bool] = False  # a row's update: its value, slots and gradient

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        _require(self.initial_accumulator_value >= 0,
                 f"Adagrad initial_accumulator_value must be >= 0, "
                 f"got {self.initial_accumulator_value}")
        _require(self.epsilon >= 0, f"Adagrad epsilon must be >= 0, got {self.epsilon}")

    def slot_names(self) -> tuple[str, ...]:
        return ("accumulator",)


@dataclass(frozen=True)
class _Moments:
    """The hyper-parameters Adam, Adamax and Nadam share (Keras 3's names and defaults)."""

    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        owner = type(self).__name__
        for name in ("beta_1", "beta_2"):
            beta = getattr(self, name)
            _require(0 <= beta < 1, f"{owner} {name} must be in [0, 1), got {beta}")
        _require(self.epsilon >= 0, f"{owner} epsilon must be >= 0, got {self.epsilon}")


@dataclass(frozen=True)
class Adam(_Moments):
    """Keras 3 `Adam` (optionally AMSGrad), applied lazily to the rows a step touches."""

    amsgrad: bool = False
    kind: ClassVar[str] = "adam"
    counts_steps: ClassVar[bool] = True  # bias correction by the table's step

    def slot_names(self) -> tuple[str, ...]:
        moments = ("momentum", "velocity")
        return moments + ("velocity_hat",) if self.amsgrad else moments


@dataclass(frozen=True)
class Ftrl:
    """Keras 3 `Ftrl`."""

    learning_rate: float = 0.001
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0
    kind: ClassVar[str] = "ftrl"
    counts_steps: ClassVar[bool] = False  # a row's update: its value, slots and gradient

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        _require(self.learning_rate_power <= 0,
                 f"Ftrl learning_rate_power must be <= 0, got {self.learning_rate_power}")
        _require(self.initial_accumulator_value >= 0,
                 f"Ftrl initial_accumulator_value must be >= 0, "
                 f"got {self.initial_accumulator_value}")
        for name in ("l1_regularization_strength", "l2_regularization_strength",
                     "l2_shrinkage_regularization_strength", "beta"):
            value = getattr(self, name)
            _require(value >= 0, f"Ftrl {name} must be >= 0, got {value}")

    def slot_names(self) -> tuple[str, ...]:
        return ("accumulator", "linear")


@dataclass(frozen=True)
class RMSprop:
    """Keras 3 `RMSprop`, plain, with momentum and/or centered, applied lazily."""

    learning_rate: float = 0.001
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False
    kind: ClassVar[str] = "rmsprop"
    counts_steps: ClassVar[bool] = False  # a row's update: its value, slots and gradient

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        _require(0 <= self.rho <= 1, f"RMSprop rho must be in [0, 1], got {self.rho}")
        _require(0 <= self.momentum <= 1,
                 f"RMSprop momentum must be in [0, 1], got {self.momentum}")
        _require(self.epsilon >= 0, f"RMSprop epsilon must be >= 0, got {self.epsilon}")

    def slot_names(self) -> tuple[str, ...]:
        return ("velocity",) + (("momentum",) if self.momentum > 0 else ()) + \
            (("average_gradient",) if self.centered else ())


@dataclass(frozen=True)
class Adamax(_Moments):
    """Keras 3 `Adamax`, applied lazily to the rows a step touches."""

    kind: ClassVar[str] = "adamax"
    counts_steps: ClassVar[bool] = True  # bias correction by the table's step

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "norm")


@dataclass(frozen=True)
class Nadam(_Moments):
    """Keras 3 `Nadam`, applied lazily; its `u_product` is a function of the table's step."""

    kind: ClassVar[str] = "nadam"
    counts_steps: ClassVar[bool] = True  # bias correction by the table's step

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum", "velocity")


@dataclass(frozen=True)
class Lion:
    """Keras 3 `Lion` (sign update), applied lazily to the rows a step touches."""

    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.99
    kind: ClassVar[str] = "lion"
    counts_steps: ClassVar[bool] = False  # a row's update: its value, slots and gradient

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate)
        _require(0 < self.beta_1 <= 1, f"Lion beta_1 must be in (0, 1], got {self.beta_1}")
        _require(0 <= self.beta_2 <= 1, f"Lion beta_2 must be in [0, 1], got {self.beta_2}")

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",)


# The one list of server-side optimizers: a new one is a dataclass above (fields named as in
# Keras and in its proto message; `kind`; `slot_names`; `counts_steps`: whether its update of
# a row uses the table's step count), its entry here, its message in the OptimizerSpec
# oneof of ps.proto (field name = `kind`) and its update in servers/parallax_ps/optimizers.py.
OptimizerSpec = Union[SGD, Adagrad, Adam, Ftrl, RMSprop, Adamax, Nadam, Lion]
_OPTIMIZERS: dict[str, type] = {cls.kind: cls for cls in get_args(OptimizerSpec)}
SERVER_OPTIMIZERS = ", ".join(cls.__name__ for cls in _OPTIMIZERS.values())


def _check_learning_rate(lr: float) -> None:
    _require(math.isfinite(lr) and lr > 0, f"learning_rate must be a finite number > 0, got {lr}")


def optimizer_to_proto(opt: OptimizerSpec) -> ps_pb2.OptimizerSpec:
    if type(opt) not in _OPTIMIZERS.values():
        raise ConfigError(f"optimizer {opt!r} is not a server-side optimizer; use one of "
                          f"{SERVER_OPTIMIZERS} from parallax.protocol.specs")
    return ps_pb2.OptimizerSpec(**{opt.kind: dataclasses.asdict(opt)})


def optimizer_from_proto(msg: ps_pb2.OptimizerSpec) -> OptimizerSpec:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ConfigError(f"optimizer is unset; use one of {sorted(_OPTIMIZERS)}")
    payload = getattr(msg, kind)
    cls = _OPTIMIZERS[kind]
    return cls(**{f.name: getattr(payload, f.name) for f in dataclasses.fields(cls)})


# Keras optimizer options applied on the worker around the update, which the servers' update
# of a table cannot follow: why, for each (the tables stay right on the workers, all-reduced)
_CLIPS_SUMMED = ("clips each gradient on the worker, where a table's gradient is already summed "
                 "per id (Keras clips each occurrence's slice: another result where ids repeat "
                 "in a batch)")
_WORKER_SIDE_OPTIONS = {
    "weight_decay": "decays every variable by assigning to it on the worker, outside the "
                    "update the servers apply",
    "use_ema": "keeps a moving average of every variable in a worker copy of it (a whole "
               "table, read each step) and writes it into the variables at the end of fit",
    "gradient_accumulation_steps": "sums each variable's gradients in a worker copy of it (a "
                                   "whole table) between the steps it applies",
    "clipnorm": _CLIPS_SUMMED,
    "clipvalue": _CLIPS_SUMMED,
    "global_clipnorm": "scales every gradient on the worker by their global norm, which makes "
                       "a table's gradient dense (the whole table, every step) and counts it "
                       "summed per id",
}


def keep_on_workers(tables: Sequence[str]) -> str:
    """The ways to keep `tables` (named; a placeholder without) on the workers."""
    placement = {table: "allreduce" for table in (list(tables) or ["<variable name>"])}
    return (f"ParallaxStrategy(placement={placement!r}) for these variables, or "
            f"ParallaxStrategy(mode='allreduce') for every variable")


def optimizer_from_keras(optimizer: object, tables: Sequence[str] = ()) -> OptimizerSpec:
    """The server-side twin of a Keras 3 optimizer: same class, same hyper-parameters.
    `tables`: the variables bound for the servers, named in the refusal of an optimizer (or
    an option, `_WORKER_SIDE_OPTIONS`) the servers do not have."""
    name = type(optimizer).__name__.lower()
    if name not in _OPTIMIZERS:
        keras_name = type(optimizer).__name__
        raise ConfigError(
            f"Keras optimizer {keras_name} has no server-side version (the parameter servers "
            f"apply {SERVER_OPTIMIZERS}); compile with one of those, or keep the tables on the "
            f"workers, all-reduced and updated by {keras_name} there: "
            f"{keep_on_workers(tables)}")
    # the optimizer's attributes, not get_config(): that serializes a learning-rate schedule,
    # and a schedule without get_config() (the TF Transformer tutorial's CustomSchedule)
    # raises NotImplementedError; the rate is read per step, where the update is applied
    for option, why in _WORKER_SIDE_OPTIONS.items():
        if getattr(optimizer, option, None):
            raise ConfigError(
                f"Keras optimizer option {option}={getattr(optimizer, option)!r} of "
                f"{type(optimizer).__name__} {why}: parallax cannot follow that for tables on "
                f"the parameter servers. Remove the option, or keep the tables on the "
                f"workers, all-reduced and updated by Keras there: {keep_on_workers(tables)}")
    cls = _OPTIMIZERS[name]
    values = {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(cls)
              if f.name != "learning_rate" and hasattr(optimizer, f.name)}
    values["learning_rate"] = _spec_rate(cls, optimizer.learning_rate)
    return cls(**values)


# A push's learning_rate of 0 means "the table's optimizer spec's" on the wire; a rate of 0
# (Keras' rate at a warmup's start or a decay's end) travels as the smallest normal double
# instead (parallax.tf.graph.remote.pushed_rate), which a float32 table reads as 0 and which
# moves no float64 weight above about 1e-292. Ftrl divides by the rate: the servers refuse
# it at this rate (Keras' own Ftrl turns the weights to NaN at 0).
ZERO_RATE = float(np.finfo(np.float64).tiny)


def _spec_rate(cls: type, current) -> float:
    """The spec's rate of a Keras optimizer whose rate is now `current`. The worker sends
    Keras' rate with every push, so the spec's is only a stand-in: a rate of 0 now (a
    warmup schedule's first step) takes the class default rather than a refusal."""
    rate = float(current.numpy() if hasattr(current, "numpy") else current)
    return rate if rate != 0 else cls.learning_rate


def counts_steps(optimizer: object) -> bool:
    """Whether the server-side twin of a Keras optimizer updates a row by the table's step
    count (Adam, Adamax, Nadam), not by the row, its slots and its gradient alone; True for
    an optimizer the servers do not have."""
    cls = _OPTIMIZERS.get(type(optimizer).__name__.lower())
    return cls is None or getattr(cls, "counts_steps", True)  # undeclared: the safe answer


def slot_names(spec: OptimizerSpec) -> tuple[str, ...]:
    """The per-row state a server keeps for this optimizer, besides the values (Keras' names
    of its optimizer variables)."""
    return spec.slot_names()


def _check_optimizer_values(table: str, spec: OptimizerSpec, largest: float,
                            dtype: str) -> None:
    """Every hyper-parameter finite, and every slot's initial value within the table's dtype:
    an accumulator starting at inf (or at 1e39 in float32) would refuse every update."""
    for item in dataclasses.fields(spec):
        value = getattr(spec, item.name)
        if isinstance(value, float):
            _require(math.isfinite(value), f"table {table!r}: optimizer {spec.kind} "
                     f"{item.name} must be finite, got {value}")
    for name in spec.slot_names():
        start = slot_initial_value(spec, name)
        _require(abs(start) <= largest, f"table {table!r}: optimizer {spec.kind} slot "
                 f"{name!r} starts at {start:g}, beyond the largest {dtype} ({largest:g}); "
                 f"use a smaller initial value or dtype 'float64'")


def slot_initial_value(spec: OptimizerSpec, name: str) -> float:
    """A slot's value before a row's first update: `initial_<name>_value` where the spec has
    one (Adagrad's and Ftrl's accumulator), else 0, as in Keras."""
    return float(getattr(spec, f"initial_{name}_value", 0.0))


EVICTIONS = ("none", "lru", "lfu")  # TableSpec.eviction


def bound_for(total_rows: int, shards: int) -> int:
    """The per-shard bound of a keyed table that must hold `total_rows` rows over `shards`
    shards: keys route by hash, so a shard gets their share m = total_rows / shards, give
    or take the binomial spread; it may hold m plus 4 standard deviations (sqrt(m)). 0
    (unbounded) stays 0."""
    if not total_rows:
        return 0
    share = total_rows / shards
    return math.ceil(share + 4 * math.sqrt(share))


@dataclass(frozen=True)
class TableSpec:
    """A sparse table as every shard of it sees it.

    Two kinds of table: a fixed table has `vocabulary_size` rows, ids in [0,
    vocabulary_size); `hashed_keys=True` makes a *keyed* table instead, whose ids are
    arbitrary int64 keys (routed to shards by a hash of the key), a row created on first
    use, optionally bounded by `max_rows_per_shard`. A keyed table whose rows are admitted,
    evicted or have their uses counted (`admit_after`, `admit_probability`, `eviction`,
    `ttl_steps`, `count_uses`; see `dynamic`) is a *dynamic* table, as every
    `parallax.layers.DynamicEmbedding`'s is. The field keeps its wire name, `hashed_keys`.
    """

    name: str
    dim: int
    vocabulary_size: int = 0
    hashed_keys: bool = False
    max_rows_per_shard: int = 0
    dtype: str = "float32"
    initializer: Initializer = field(default_factory=Initializer)
    optimizer: OptimizerSpec = field(default_factory=SGD)
    shard_count: int = 1
    partition: str = "mod"
    num_workers: int = 1
    sync_mode: str = "sync"
    aggregation: str = "sum"
    allow_non_finite: bool = False
    wire_dtype: str = ""  # rows on the wire: "" (= dtype), "float16" or "bfloat16"
    admit_after: int = 0  # sightings before a key gets a row (0/1: at once)
    admit_probability: float = 1.0  # chance per sighting (deterministic by key and count)
    eviction: str = "none"  # "none", "lru" or "lfu": keep max_rows_per_shard by evicting
    ttl_steps: int = 0  # evict rows unused for this many of the shard's steps (0: off)
    count_uses: bool = False  # keep use counts and last-used steps without admission/eviction

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(_TABLE_NAME.match(self.name)),
                 f"table name {self.name!r} is invalid; use 1-128 letters, digits, '_', '.', '-'"
                 f" not starting with '.' or '-'")
        _require(isinstance(self.dim, int) and self.dim > 0,
                 f"table {self.name!r}: dim must be a positive int, got {self.dim!r}")
        if self.hashed_keys:
            _require(self.vocabulary_size == 0, f"table {self.name!r}: keyed tables "
                     f"(hashed_keys=True) take any int64 key; set vocabulary_size=0, got "
                     f"{self.vocabulary_size}")
            _require(self.partition == "mod", f"table {self.name!r}: keyed tables "
                     f"(hashed_keys=True) route by key hash; partition must be 'mod', got "
                     f"{self.partition!r}")
            _require(self.max_rows_per_shard >= 0, f"table {self.name!r}: max_rows_per_shard "
                     f"must be >= 0, got {self.max_rows_per_shard}")
        else:
            _require(isinstance(self.vocabulary_size, int) and self.vocabulary_size > 0,
                     f"table {self.name!r}: vocabulary_size must be > 0 (or set hashed_keys=True)"
                     f", got {self.vocabulary_size!r}")
            _require(self.max_rows_per_shard == 0, f"table {self.name!r}: max_rows_per_shard "
                     f"applies to keyed tables (hashed_keys=True) only")
        _require(self.dtype in ("float32", "float64"), f"table {self.name!r}: dtype must be "
                 f"'float32' or 'float64', got {self.dtype!r}")
        largest = float(np.finfo(self.dtype).max)
        _require(self.initializer.largest() <= largest, f"table {self.name!r}: the "
                 f"{self.initializer.kind} initializer can reach {self.initializer.largest():g}, "
                 f"beyond the largest {self.dtype} ({largest:g}); initial values would be "
                 f"infinite: use smaller initializer values or dtype 'float64'")
        _require(type(self.optimizer) in _OPTIMIZERS.values(), f"table {self.name!r}: optimizer "
                 f"{self.optimizer!r} is not one of parallax.protocol.specs {SERVER_OPTIMIZERS}")
        _check_optimizer_values(self.name, self.optimizer, largest, self.dtype)
        _require(isinstance(self.shard_count, int) and self.shard_count >= 1,
                 f"table {self.name!r}: shard_count must be >= 1, got {self.shard_count!r}")
        _require(self.hashed_keys or self.shard_count <= self.vocabulary_size,
                 f"table {self.name!r}: shard_count {self.shard_count} exceeds vocabulary_size "
                 f"{self.vocabulary_size}; use at most {self.vocabulary_size} shards")
        _lookup(_PARTITIONS, self.partition, f"table {self.name!r}: partition")
        _require(isinstance(self.num_workers, int) and self.num_workers >= 1,
                 f"table {self.name!r}: num_workers must be >= 1, got {self.num_workers!r}")
        _lookup(_SYNC_MODES, self.sync_mode, f"table {self.name!r}: sync_mode")
        _lookup(_AGGREGATIONS, self.aggregation, f"table {self.name!r}: aggregation")
        self._check_wire_dtype()
        self._check_dynamic()

    @property
    def dynamic(self) -> bool:
        """Whether this is a dynamic table: a keyed one whose rows are admitted or evicted
        (rather than created on first use and kept), or their use is counted: the tables
        whose shards keep each row's use history."""
        return (self.admit_after > 1 or self.admit_probability < 1 or self.eviction != "none"
                or self.ttl_steps > 0 or self.count_uses)

    def _check_dynamic(self) -> None:
        name = self.name
        if self.eviction == "":  # the wire's unset value
            object.__setattr__(self, "eviction", "none")
        _require(isinstance(self.admit_after, int) and self.admit_after >= 0,
                 f"table {name!r}: admit_after must be an int >= 0 (0 or 1: a key gets a row "
                 f"at once), got {self.admit_after!r}")
        _require(isinstance(self.admit_probability, (int, float))
                 and 0 < self.admit_probability <= 1, f"table {name!r}: admit_probability "
                 f"must be in (0, 1] (1: admit on the admit_after-th sighting), got "
                 f"{self.admit_probability!r}")
        _require(self.eviction in EVICTIONS, f"table {name!r}: eviction {self.eviction!r} is "
                 f"not supported; use one of {list(EVICTIONS)}")
        _require(isinstance(self.ttl_steps, int) and self.ttl_steps >= 0,
                 f"table {name!r}: ttl_steps must be an int >= 0 (0: off), got "
                 f"{self.ttl_steps!r}")
        _require(not self.dynamic or self.hashed_keys, f"table {name!r}: admit_after, "
                 f"admit_probability, eviction, ttl_steps and count_uses apply to keyed tables "
                 f"(hashed_keys=True) only; "
                 f"set hashed_keys=True or leave them at their defaults")
        _require(self.eviction == "none" or self.max_rows_per_shard > 0, f"table {name!r}: "
                 f"eviction {self.eviction!r} keeps max_rows_per_shard by evicting, but "
                 f"max_rows_per_shard is 0 (unbounded); set it, or eviction='none'")

    def resharded(self, name: str, shard_count: int,
                  max_rows_per_shard: int | None = None) -> "TableSpec":
        """This table as `name` over `shard_count` shards. A bounded keyed table gets
        `max_rows_per_shard`, or by default its own at the same shard count and else room
        for the rows it may hold now (`bound_for` of its bound times its shards), so a
        reshard keeps every row (a hash split more uneven than 4 standard deviations
        aside)."""
        if max_rows_per_shard is None and shard_count == self.shard_count:
            max_rows_per_shard = self.max_rows_per_shard  # moved to other servers only
        elif max_rows_per_shard is None:
            max_rows_per_shard = bound_for(self.max_rows_per_shard * self.shard_count,
                                           shard_count) if self.hashed_keys else 0
        return dataclasses.replace(self, name=name, shard_count=shard_count,
                                   max_rows_per_shard=max_rows_per_shard)

    def _check_wire_dtype(self) -> None:
        if self.wire_dtype == self.dtype:  # the same as unset: one spelling, one spec
            object.__setattr__(self, "wire_dtype", "")
        allowed = ("",) + wire_dtypes.COMPRESSED
        _require(self.wire_dtype in allowed, f"table {self.name!r}: wire_dtype "
                 f"{self.wire_dtype!r} is not supported; use one of {list(allowed)} ('' or "
                 f"{self.dtype!r}: rows travel as the table's dtype)")
        _require(not self.wire_dtype or self.dtype == "float32", f"table {self.name!r}: "
                 f"wire_dtype {self.wire_dtype!r} needs dtype 'float32', got {self.dtype!r}")

    @property
    def row_wire_dtype(self) -> str:
        """The dtype rows travel in: `wire_dtype`, else the table's own."""
        return self.wire_dtype or self.dtype

    def to_proto(self) -> ps_pb2.TableSpec:
        return ps_pb2.TableSpec(
            name=self.name, vocabulary_size=self.vocabulary_size, hashed_keys=self.hashed_keys,
            max_rows_per_shard=self.max_rows_per_shard, dim=self.dim,
            dtype=wire.dtype_code(self.dtype), initializer=self.initializer.to_proto(),
            optimizer=optimizer_to_proto(self.optimizer), shard_count=self.shard_count,
            partition=_PARTITIONS[self.partition], num_workers=self.num_workers,
            sync_mode=_SYNC_MODES[self.sync_mode], aggregation=_AGGREGATIONS[self.aggregation],
            allow_non_finite=self.allow_non_finite,
            wire_dtype=wire.dtype_code(self.wire_dtype) if self.wire_dtype else 0,
            admit_after=self.admit_after,
            admit_probability=0.0 if self.admit_probability == 1 else self.admit_probability,
            eviction="" if self.eviction == "none" else self.eviction,
            ttl_steps=self.ttl_steps, count_uses=self.count_uses)

    @classmethod
    def from_proto(cls, msg: ps_pb2.TableSpec) -> "TableSpec":
        try:
            dtype = wire.dtype_name(msg.dtype)
            wire_dtype = wire.dtype_name(msg.wire_dtype) if msg.wire_dtype else ""
        except wire.WireError as exc:
            raise ConfigError(f"table {msg.name!r}: {exc}") from None
        return cls(
            name=msg.name, dim=msg.dim, vocabulary_size=msg.vocabulary_size,
            hashed_keys=msg.hashed_keys, max_rows_per_shard=msg.max_rows_per_shard, dtype=dtype,
            initializer=Initializer.from_proto(msg.initializer),
            optimizer=optimizer_from_proto(msg.optimizer), shard_count=msg.shard_count,
            partition=_reverse(_PARTITIONS, msg.partition, "partition"),
            num_workers=msg.num_workers,
            sync_mode=_reverse(_SYNC_MODES, msg.sync_mode, "sync_mode"),
            aggregation=_reverse(_AGGREGATIONS, msg.aggregation, "aggregation"),
            allow_non_finite=msg.allow_non_finite, wire_dtype=wire_dtype,
            admit_after=msg.admit_after, admit_probability=msg.admit_probability or 1.0,
            eviction=msg.eviction or "none", ttl_steps=msg.ttl_steps,
            count_uses=msg.count_uses)

    def describe_difference(self, other: "TableSpec") -> str:
        """'dim 64 != 32, ...': the fields in which two specs of one table disagree."""
        pairs = [(f.name, getattr(self, f.name), getattr(other, f.name))
                 for f in dataclasses.fields(self)]
        diffs = [f"{name} {mine!r} != {theirs!r}" for name, mine, theirs in pairs if mine != theirs]
        return ", ".join(diffs)
