from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Partition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARTITION_UNSPECIFIED: _ClassVar[Partition]
    MOD: _ClassVar[Partition]
    RANGE: _ClassVar[Partition]

class SyncMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_MODE_UNSPECIFIED: _ClassVar[SyncMode]
    SYNC: _ClassVar[SyncMode]
    ASYNC: _ClassVar[SyncMode]

class Aggregation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGGREGATION_UNSPECIFIED: _ClassVar[Aggregation]
    SUM: _ClassVar[Aggregation]
    MEAN: _ClassVar[Aggregation]

class SavePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_PHASE_UNSPECIFIED: _ClassVar[SavePhase]
    SAVE_PREPARE: _ClassVar[SavePhase]
    SAVE_COMMIT: _ClassVar[SavePhase]
    SAVE_ABORT: _ClassVar[SavePhase]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
INT32: DType
INT64: DType
BFLOAT16: DType
PARTITION_UNSPECIFIED: Partition
MOD: Partition
RANGE: Partition
SYNC_MODE_UNSPECIFIED: SyncMode
SYNC: SyncMode
ASYNC: SyncMode
AGGREGATION_UNSPECIFIED: Aggregation
SUM: Aggregation
MEAN: Aggregation
SAVE_PHASE_UNSPECIFIED: SavePhase
SAVE_PREPARE: SavePhase
SAVE_COMMIT: SavePhase
SAVE_ABORT: SavePhase

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "content")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    content: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., content: _Optional[bytes] = ...) -> None: ...

class InitializerSpec(_message.Message):
    __slots__ = ("kind", "value", "minval", "maxval", "mean", "stddev", "seed")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[InitializerSpec.Kind]
        ZEROS: _ClassVar[InitializerSpec.Kind]
        CONSTANT: _ClassVar[InitializerSpec.Kind]
        RANDOM_UNIFORM: _ClassVar[InitializerSpec.Kind]
        RANDOM_NORMAL: _ClassVar[InitializerSpec.Kind]
        TRUNCATED_NORMAL: _ClassVar[InitializerSpec.Kind]
    KIND_UNSPECIFIED: InitializerSpec.Kind
    ZEROS: InitializerSpec.Kind
    CONSTANT: InitializerSpec.Kind
    RANDOM_UNIFORM: InitializerSpec.Kind
    RANDOM_NORMAL: InitializerSpec.Kind
    TRUNCATED_NORMAL: InitializerSpec.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MINVAL_FIELD_NUMBER: _ClassVar[int]
    MAXVAL_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STDDEV_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: InitializerSpec.Kind
    value: float
    minval: float
    maxval: float
    mean: float
    stddev: float
    seed: int
    def __init__(self, kind: _Optional[_Union[InitializerSpec.Kind, str]] = ..., value: _Optional[float] = ..., minval: _Optional[float] = ..., maxval: _Optional[float] = ..., mean: _Optional[float] = ..., stddev: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SGD(_message.Message):
    __slots__ = ("learning_rate", "momentum", "nesterov")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    momentum: float
    nesterov: bool
    def __init__(self, learning_rate: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: bool = ...) -> None: ...

class Adagrad(_message.Message):
    __slots__ = ("learning_rate", "initial_accumulator_value", "epsilon")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    initial_accumulator_value: float
    epsilon: float
    def __init__(self, learning_rate: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class Adam(_message.Message):
    __slots__ = ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA_1_FIELD_NUMBER: _ClassVar[int]
    BETA_2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    AMSGRAD_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta_1: float
    beta_2: float
    epsilon: float
    amsgrad: bool
    def __init__(self, learning_rate: _Optional[float] = ..., beta_1: _Optional[float] = ..., beta_2: _Optional[float] = ..., epsilon: _Optional[float] = ..., amsgrad: bool = ...) -> None: ...

class Ftrl(_message.Message):
    __slots__ = ("learning_rate", "learning_rate_power", "initial_accumulator_value", "l1_regularization_strength", "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_POWER_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    L1_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    L2_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    L2_SHRINKAGE_REGULARIZATION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    learning_rate_power: float
    initial_accumulator_value: float
    l1_regularization_strength: float
    l2_regularization_strength: float
    l2_shrinkage_regularization_strength: float
    beta: float
    def __init__(self, learning_rate: _Optional[float] = ..., learning_rate_power: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., l1_regularization_strength: _Optional[float] = ..., l2_regularization_strength: _Optional[float] = ..., l2_shrinkage_regularization_strength: _Optional[float] = ..., beta: _Optional[float] = ...) -> None: ...

class RMSprop(_message.Message):
    __slots__ = ("learning_rate", "rho", "momentum", "epsilon", "centered")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    CENTERED_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    rho: float
    momentum: float
    epsilon: float
    centered: bool
    def __init__(self, learning_rate: _Optional[float] = ..., rho: _Optional[float] = ..., momentum: _Optional[float] = ..., epsilon: _Optional[float] = ..., centered: bool = ...) -> None: ...

class Adamax(_message.Message):
    __slots__ = ("learning_rate", "beta_1", "beta_2", "epsilon")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA_1_FIELD_NUMBER: _ClassVar[int]
    BETA_2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta_1: float
    beta_2: float
    epsilon: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta_1: _Optional[float] = ..., beta_2: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class Nadam(_message.Message):
    __slots__ = ("learning_rate", "beta_1", "beta_2", "epsilon")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA_1_FIELD_NUMBER: _ClassVar[int]
    BETA_2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta_1: float
    beta_2: float
    epsilon: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta_1: _Optional[float] = ..., beta_2: _Optional[float] = ..., epsilon: _Optional[float] = ...) -> None: ...

class Lion(_message.Message):
    __slots__ = ("learning_rate", "beta_1", "beta_2")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA_1_FIELD_NUMBER: _ClassVar[int]
    BETA_2_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta_1: float
    beta_2: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta_1: _Optional[float] = ..., beta_2: _Optional[float] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("sgd", "adagrad", "adam", "ftrl", "rmsprop", "adamax", "nadam", "lion")
    SGD_FIELD_NUMBER: _ClassVar[int]
    ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    FTRL_FIELD_NUMBER: _ClassVar[int]
    RMSPROP_FIELD_NUMBER: _ClassVar[int]
    ADAMAX_FIELD_NUMBER: _ClassVar[int]
    NADAM_FIELD_NUMBER: _ClassVar[int]
    LION_FIELD_NUMBER: _ClassVar[int]
    sgd: SGD
    adagrad: Adagrad
    adam: Adam
    ftrl: Ftrl
    rmsprop: RMSprop
    adamax: Adamax
    nadam: Nadam
    lion: Lion
    def __init__(self, sgd: _Optional[_Union[SGD, _Mapping]] = ..., adagrad: _Optional[_Union[Adagrad, _Mapping]] = ..., adam: _Optional[_Union[Adam, _Mapping]] = ..., ftrl: _Optional[_Union[Ftrl, _Mapping]] = ..., rmsprop: _Optional[_Union[RMSprop, _Mapping]] = ..., adamax: _Optional[_Union[Adamax, _Mapping]] = ..., nadam: _Optional[_Union[Nadam, _Mapping]] = ..., lion: _Optional[_Union[Lion, _Mapping]] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "vocabulary_size", "hashed_keys", "max_rows_per_shard", "dim", "dtype", "initializer", "optimizer", "shard_count", "partition", "num_workers", "sync_mode", "aggregation", "allow_non_finite", "wire_dtype", "admit_after", "admit_probability", "eviction", "ttl_steps", "count_uses")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASHED_KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_PER_SHARD_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_MODE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    ADMIT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    COUNT_USES_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocabulary_size: int
    hashed_keys: bool
    max_rows_per_shard: int
    dim: int
    dtype: DType
    initializer: InitializerSpec
    optimizer: OptimizerSpec
    shard_count: int
    partition: Partition
    num_workers: int
    sync_mode: SyncMode
    aggregation: Aggregation
    allow_non_finite: bool
    wire_dtype: DType
    admit_after: int
    admit_probability: float
    eviction: str
    ttl_steps: int
    count_uses: bool
    def __init__(self, name: _Optional[str] = ..., vocabulary_size: _Optional[int] = ..., hashed_keys: bool = ..., max_rows_per_shard: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., initializer: _Optional[_Union[InitializerSpec, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., shard_count: _Optional[int] = ..., partition: _Optional[_Union[Partition, str]] = ..., num_workers: _Optional[int] = ..., sync_mode: _Optional[_Union[SyncMode, str]] = ..., aggregation: _Optional[_Union[Aggregation, str]] = ..., allow_non_finite: bool = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., admit_after: _Optional[int] = ..., admit_probability: _Optional[float] = ..., eviction: _Optional[str] = ..., ttl_steps: _Optional[int] = ..., count_uses: bool = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec", "shard_index")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    shard_index: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., shard_index: _Optional[int] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("created", "rows", "step", "restored_from")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    created: bool
    rows: int
    step: int
    restored_from: str
    def __init__(self, created: bool = ..., rows: _Optional[int] = ..., step: _Optional[int] = ..., restored_from: _Optional[str] = ...) -> None: ...

class DeleteTableRequest(_message.Message):
    __slots__ = ("table", "shard_index")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ...) -> None: ...

class DeleteTableResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InitRowsChunk(_message.Message):
    __slots__ = ("table", "shard_index", "ids", "values", "last")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    ids: Tensor
    values: Tensor
    last: bool
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., last: bool = ...) -> None: ...

class InitRowsResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("table", "shard_index", "ids", "min_step", "full_precision")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    FULL_PRECISION_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    ids: Tensor
    min_step: int
    full_precision: bool
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., min_step: _Optional[int] = ..., full_precision: bool = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("values", "step")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    values: Tensor
    step: int
    def __init__(self, values: _Optional[_Union[Tensor, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("table", "shard_index", "step", "worker", "ids", "grads", "learning_rate", "chunk_index", "chunk_count", "session")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    step: int
    worker: int
    ids: Tensor
    grads: Tensor
    learning_rate: float
    chunk_index: int
    chunk_count: int
    session: int
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., step: _Optional[int] = ..., worker: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., grads: _Optional[_Union[Tensor, _Mapping]] = ..., learning_rate: _Optional[float] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., session: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("step", "applied")
    STEP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    step: int
    applied: bool
    def __init__(self, step: _Optional[int] = ..., applied: bool = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("table", "shard_index", "min_step")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    min_step: int
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., min_step: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step", "pushed_workers")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUSHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    step: int
    pushed_workers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., pushed_workers: _Optional[_Iterable[int]] = ...) -> None: ...

class BarrierRequest(_message.Message):
    __slots__ = ("name", "rank", "count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    count: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class BarrierResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("path", "tables", "checkpoint", "phase", "keep", "held", "state")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    path: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    checkpoint: str
    phase: SavePhase
    keep: int
    held: bool
    state: StatePiece
    def __init__(self, path: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ..., checkpoint: _Optional[str] = ..., phase: _Optional[_Union[SavePhase, str]] = ..., keep: _Optional[int] = ..., held: bool = ..., state: _Optional[_Union[StatePiece, _Mapping]] = ...) -> None: ...

class StatePiece(_message.Message):
    __slots__ = ("checkpoint", "index", "count", "data", "bytes")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    index: int
    count: int
    data: bytes
    bytes: int
    def __init__(self, checkpoint: _Optional[str] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., data: _Optional[bytes] = ..., bytes: _Optional[int] = ...) -> None: ...

class ShardCheckpoint(_message.Message):
    __slots__ = ("table", "shard_index", "rows", "step", "file", "checkpoint", "sync")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    rows: int
    step: int
    file: str
    checkpoint: str
    sync: bool
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., rows: _Optional[int] = ..., step: _Optional[int] = ..., file: _Optional[str] = ..., checkpoint: _Optional[str] = ..., sync: bool = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("shards", "max_message_bytes")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardCheckpoint]
    max_message_bytes: int
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardCheckpoint, _Mapping]]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("path", "tables", "checkpoint", "verify_only", "held", "discard_pending", "state_piece")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ONLY_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DISCARD_PENDING_FIELD_NUMBER: _ClassVar[int]
    STATE_PIECE_FIELD_NUMBER: _ClassVar[int]
    path: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    checkpoint: str
    verify_only: bool
    held: bool
    discard_pending: bool
    state_piece: int
    def __init__(self, path: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ..., checkpoint: _Optional[str] = ..., verify_only: bool = ..., held: bool = ..., discard_pending: bool = ..., state_piece: _Optional[int] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("shards", "states")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardCheckpoint]
    states: _containers.RepeatedCompositeFieldContainer[StatePiece]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardCheckpoint, _Mapping]]] = ..., states: _Optional[_Iterable[_Union[StatePiece, _Mapping]]] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("table", "shard_index", "offset", "max_rows", "changed_only")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_ONLY_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    offset: int
    max_rows: int
    changed_only: bool
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., offset: _Optional[int] = ..., max_rows: _Optional[int] = ..., changed_only: bool = ...) -> None: ...

class ShardRows(_message.Message):
    __slots__ = ("table", "shard_index", "step", "ids", "values", "slot_names", "slots", "next_offset", "total_rows", "restart_changes", "uses", "last_used")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SLOT_NAMES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    RESTART_CHANGES_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    step: int
    ids: Tensor
    values: Tensor
    slot_names: _containers.RepeatedScalarFieldContainer[str]
    slots: _containers.RepeatedCompositeFieldContainer[Tensor]
    next_offset: int
    total_rows: int
    restart_changes: bool
    uses: Tensor
    last_used: Tensor
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., step: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., slot_names: _Optional[_Iterable[str]] = ..., slots: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., next_offset: _Optional[int] = ..., total_rows: _Optional[int] = ..., restart_changes: bool = ..., uses: _Optional[_Union[Tensor, _Mapping]] = ..., last_used: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ImportRowsResponse(_message.Message):
    __slots__ = ("rows", "step")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    rows: int
    step: int
    def __init__(self, rows: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class MethodStats(_message.Message):
    __slots__ = ("method", "requests", "errors", "rows", "bytes", "total_seconds", "max_seconds")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    method: str
    requests: int
    errors: int
    rows: int
    bytes: int
    total_seconds: float
    max_seconds: float
    def __init__(self, method: _Optional[str] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., total_seconds: _Optional[float] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("table", "shard_index", "shard_count", "rows", "dim", "dtype", "bytes", "step", "pushed_workers", "methods", "dynamic")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUSHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    table: str
    shard_index: int
    shard_count: int
    rows: int
    dim: int
    dtype: DType
    bytes: int
    step: int
    pushed_workers: _containers.RepeatedScalarFieldContainer[int]
    methods: _containers.RepeatedCompositeFieldContainer[MethodStats]
    dynamic: DynamicStats
    def __init__(self, table: _Optional[str] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., bytes: _Optional[int] = ..., step: _Optional[int] = ..., pushed_workers: _Optional[_Iterable[int]] = ..., methods: _Optional[_Iterable[_Union[MethodStats, _Mapping]]] = ..., dynamic: _Optional[_Union[DynamicStats, _Mapping]] = ...) -> None: ...

class DynamicStats(_message.Message):
    __slots__ = ("admitted", "evicted_capacity", "evicted_ttl", "dropped_gradients", "default_rows")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TTL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ROWS_FIELD_NUMBER: _ClassVar[int]
    admitted: int
    evicted_capacity: int
    evicted_ttl: int
    dropped_gradients: int
    default_rows: int
    def __init__(self, admitted: _Optional[int] = ..., evicted_capacity: _Optional[int] = ..., evicted_ttl: _Optional[int] = ..., dropped_gradients: _Optional[int] = ..., default_rows: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tables: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("server_version", "protocol_version", "pid", "max_message_bytes", "tables", "memory_bytes", "methods")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    protocol_version: int
    pid: int
    max_message_bytes: int
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    memory_bytes: int
    methods: _containers.RepeatedCompositeFieldContainer[MethodStats]
    def __init__(self, server_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., pid: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., memory_bytes: _Optional[int] = ..., methods: _Optional[_Iterable[_Union[MethodStats, _Mapping]]] = ...) -> None: ...

class PullManyRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PullRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ...) -> None: ...

class PullManyResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PullResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[PullResponse, _Mapping]]] = ...) -> None: ...

class PushManyRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PushRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ...) -> None: ...

class PushManyResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[PushResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[PushResponse, _Mapping]]] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneResponse(_message.Message):
    __slots__ = ("port", "version", "server_id", "max_message_bytes", "idle_timeout_s", "packed")
    PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    port: int
    version: int
    server_id: int
    max_message_bytes: int
    idle_timeout_s: int
    packed: bool
    def __init__(self, port: _Optional[int] = ..., version: _Optional[int] = ..., server_id: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., idle_timeout_s: _Optional[int] = ..., packed: bool = ...) -> None: ...
