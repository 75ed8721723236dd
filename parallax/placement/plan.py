"""The placement plan: for every trainable variable, sparse or dense (with the reason), where
it lives (parameter servers or replicated and all-reduced), its size and shard count.

Built once, at the first training step, from what graph inspection saw; the same on every
worker (checked), logged once by the chief, and exposed as `strategy.plan`.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Mapping

from parallax.env import RUN_MODES
from parallax.errors import ConfigError
from parallax.protocol.specs import bound_for
from parallax.protocol.wire_dtypes import WIRE_DTYPES
from parallax.placement.planner.placer import place
from parallax.placement.planner.types import ClusterProfile, TableProfile, by_name

# A table is split into shards of at least this size by default (at most one per server).
# A shard on a server a worker's step reaches anyway costs a part of that request (tens of
# microseconds of server CPU); on one it would not reach otherwise, a pull and a push per
# step (~200 us of CPU on each side on the data plane, docs/benchmarks.md). What sharding
# buys is spreading a table's rows, bytes and traffic over the servers, and when servers
# share the workers' hosts (equal hardware) the busiest host sets the step time: lm's two
# 128 MB tables whole on 2 of 4 co-located servers ran ~15% slower than in 4 shards each
# (2026-12-04, docs/benchmarks.md). Small tables are spread over the servers whole (see
# `place_shards`). (64 MiB until then, chosen when a request cost ~1 ms in Python gRPC.)
SHARD_MIN_BYTES = 16 << 20
PLACEMENTS = ("ps", "allreduce")


@dataclass(frozen=True)
class DynamicRows:
    """A dynamic table's rows (`parallax.layers.DynamicEmbedding`): keyed by any int64, so
    its server table is a keyed table (`hashed_keys=True`); rows are admitted, bounded and
    evicted as its `TableSpec` fields of the same names say (parallax.protocol.specs)."""

    max_rows_per_shard: int = 0  # 0: unbounded
    total_rows: int = 0  # the bound over every shard, as first planned (see `resharded`)
    planned_shards: int = 0  # the shard count it was first planned with
    admit_after: int = 0
    admit_probability: float = 1.0
    eviction: str = "none"
    ttl_steps: int = 0

    def spec_fields(self) -> dict:
        """The TableSpec fields of these rows (`TableSpec(**fields)` checks them)."""
        return dict(hashed_keys=True, vocabulary_size=0, partition="mod",
                    max_rows_per_shard=self.max_rows_per_shard, admit_after=self.admit_after,
                    admit_probability=self.admit_probability, eviction=self.eviction,
                    ttl_steps=self.ttl_steps, count_uses=True)  # top-N exports rank by use

    def planned(self, shards: int) -> "DynamicRows":
        """As first planned over `shards` shards: the user's bound on each."""
        return replace(self, total_rows=self.max_rows_per_shard * shards,
                       planned_shards=shards)

    def resharded(self, shards: int) -> "DynamicRows":
        """These rows over another shard count: room on each shard for its share of the
        planned total (`parallax.protocol.specs.bound_for`), so a reshard or the partition
        search's layout keeps what the table holds, and sampling layouts back and forth
        does not inflate the bound."""
        if shards == self.planned_shards:  # back where it was planned: the user's bound
            return replace(self, max_rows_per_shard=self.total_rows // shards)
        return replace(self, max_rows_per_shard=bound_for(self.total_rows, shards))

    def describe(self) -> str:
        """"dynamic: <= 1000 rows/shard (lru), admit after 2, ttl 50 steps"."""
        bound = (f"<= {self.max_rows_per_shard} rows/shard ({self.eviction})"
                 if self.max_rows_per_shard else "unbounded")
        parts = [bound]
        if self.admit_after > 1:
            parts.append(f"admit after {self.admit_after}")
        if self.admit_probability < 1:
            parts.append(f"admit p={self.admit_probability:g}")
        if self.ttl_steps:
            parts.append(f"ttl {self.ttl_steps} steps")
        return "dynamic: " + ", ".join(parts)


@dataclass(frozen=True)
class PlacementOptions:
    """What the plan is made of among the user's choices (`make_plan`, and the partition
    search's `tuning.resolve`); the strategy's options (`StrategyConfig`, in
    parallax.tf.strategy.config) build it (`StrategyConfig.placement_options`). The defaults
    plan synchronous hybrid mode."""

    mode: str = "hybrid"
    sync: bool = True
    placement: Mapping[str, str] = field(default_factory=dict)  # variable name -> ps|allreduce
    shards: int | Mapping[str, int] | None = None  # default: one per 16 MiB, <= servers
    group_tables: bool = True  # same-shaped sparse variables share a server table (see below)
    # rows of server tables on the wire: one dtype for every float32 table, or variable
    # name -> dtype; None: each table's own (parallax.protocol.wire_dtypes)
    wire_dtype: str | Mapping[str, str] | None = None
    cache: object = None  # the worker's hot-row cache (its `describe()` goes in the plan)

    def __post_init__(self) -> None:
        if self.mode not in RUN_MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(RUN_MODES)}")
        for name, where in self.placement.items():
            if where not in PLACEMENTS:
                raise ConfigError(f"placement of {name!r} is {where!r}; use 'ps' (rows on the "
                                  f"parameter servers) or 'allreduce' (replicated)")
        if not isinstance(self.group_tables, bool):
            raise ConfigError(f"group_tables must be True or False, got {self.group_tables!r}")
        wires = self.wire_dtype.items() if isinstance(self.wire_dtype, Mapping) else \
            [("", self.wire_dtype)]
        for name, dtype in wires:
            if dtype is not None and dtype not in WIRE_DTYPES:
                where = f" of {name!r}" if name else ""
                raise ConfigError(f"wire_dtype{where} is {dtype!r}; use one of "
                                  f"{', '.join(WIRE_DTYPES)} (rows of the tables on the "
                                  f"servers as they travel; the servers keep float32)")
        shards = self.shards.values() if isinstance(self.shards, Mapping) else [self.shards]
        for count in shards:
            if count is not None and not is_count(count):
                raise ConfigError(f"shards must be positive ints, got {count!r}")


def is_count(value) -> bool:
    """An int >= 1 (a bool is no count, though Python makes it an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a variable dtype name (bfloat16 included, which numpy lacks)."""
    return 2 if dtype in ("float16", "bfloat16") else 8 if dtype in ("float64", "int64") else 4


@dataclass(frozen=True)
class VariableInfo:
    """What the planner knows about one variable before deciding."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    gather_only: bool
    read_reason: str
    gradient: str  # "IndexedSlices", "Tensor" or "none"
    dynamic: DynamicRows | None = None  # a DynamicEmbedding's table: a dynamic table's rows

    @property
    def bytes(self) -> int:
        """The variable's bytes (a dynamic table's: its bound per shard, 0 if unbounded; its
        shape's rows are only the layer's local stand-in)."""
        if self.dynamic is not None:
            row = int(math.prod(self.shape[1:])) * dtype_bytes(self.dtype)
            return self.dynamic.max_rows_per_shard * row
        return int(math.prod(self.shape)) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class VariablePlan:
    index: int
    name: str
    kind: str        # "sparse" or "dense"
    placement: str   # "ps" or "allreduce"
    reason: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    shards: int      # 0 for replicated variables
    table: str = ""  # the table's name on the servers
    servers: tuple[int, ...] = ()  # server of each shard (see place_shards)
    offset: int = 0  # the variable's first row in its table (a table group; see group_tables)
    table_rows: int = 0  # rows of the table on the servers: this variable's, or its group's
    wire_dtype: str = ""  # its rows on the wire when not its dtype ("float16", "bfloat16")
    dynamic: DynamicRows | None = None  # a dynamic table's rows (DynamicEmbedding)


@dataclass(frozen=True)
class Plan:
    mode: str
    sync: bool
    num_servers: int
    num_workers: int
    variables: tuple[VariablePlan, ...]
    # How each lookup of a table travels (parallax.tf.graph.fusion.LookupReport), once a training
    # step has been traced for real; not part of what workers must agree on.
    lookups: tuple = ()
    cache: str = ""  # the worker row cache, described (empty: off); not agreed on either

    @property
    def on_servers(self) -> tuple[VariablePlan, ...]:
        return tuple(v for v in self.variables if v.placement == "ps")

    @property
    def replicated(self) -> tuple[VariablePlan, ...]:
        return tuple(v for v in self.variables if v.placement == "allreduce")

    def get(self, name: str) -> VariablePlan:
        return by_name(self.variables, name, "variable")

    def signature(self) -> tuple:
        """What every worker must agree on."""
        return tuple((v.index, v.name, v.shape, v.dtype, v.placement, v.shards, v.servers,
                      v.offset, v.table_rows, v.wire_dtype, v.dynamic) for v in self.variables)

    def members(self, table: str) -> tuple[VariablePlan, ...]:
        """The variables whose rows `table` holds (several for a table group), by offset."""
        return tuple(sorted((v for v in self.on_servers if v.table == table),
                            key=lambda v: v.offset))

    @property
    def grouped(self) -> bool:
        """Whether some server table holds the rows of several variables."""
        tables = [v.table for v in self.on_servers]
        return len(set(tables)) < len(tables)

    def summary(self) -> str:
        ps, rep = self.on_servers, self.replicated
        mb = lambda vs: sum(v.bytes for v in vs) / 2**20  # noqa: E731
        head = (f"parallax plan ({self.mode}, {'sync' if self.sync else 'async'}, "
                f"{self.num_workers} worker(s), {self.num_servers} server(s)): "
                f"{len(ps)} variable(s) on the servers ({mb(ps):.1f} MiB of values), "
                f"{len(rep)} replicated and all-reduced ({mb(rep):.1f} MiB)")
        if self.mode == "hybrid" and not ps:
            head += "; no sparse variables: running as pure all-reduce"
        elif self.mode == "hybrid" and not rep:
            head += "; no dense variables: running as pure parameter server"
        if self.cache and ps:
            head += f"; {self.cache}"
        return head

    def format(self) -> str:
        """The plan as a table; a "wire" column when some table's rows travel in another
        dtype than their own."""
        wire = any(v.wire_dtype for v in self.variables)
        rows = [("variable", "kind", "placement", "shape", "MiB", "shards") +
                (("wire",) if wire else ()) + ("reason",)]
        for v in self.variables:
            rows.append((v.name, v.kind, v.placement, _shape_text(v),
                         f"{v.bytes / 2**20:.2f}", _shards_text(v)) +
                        ((v.wire_dtype or "-",) if wire else ()) + (_reason_text(v),))
        n = len(rows[0]) - 1
        widths = [max(len(r[i]) for r in rows) for i in range(n)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:n], widths)) + "  " + r[n]
                 for r in rows]
        return self.summary() + "\n" + "\n".join(lines) + self.format_lookups()

    def format_lookups(self) -> str:
        """The traced step's lookups: fused into one request per server, or why not."""
        if not self.lookups:
            return ""
        fused = sum(1 for r in self.lookups if r.fused)
        head = (f"\nlookups: {fused} of {len(self.lookups)} fused into one pull and one push "
                f"per server per step")
        width = max(len(r.variable) for r in self.lookups)
        return head + "".join(f"\n  {r.variable.ljust(width)}  "
                              f"{'fused' if r.fused else 'own request'}: {r.reason}"
                              for r in self.lookups)


def _reason_text(v: VariablePlan) -> str:
    """The reason, after a dynamic table's current bound and admission."""
    return f"{v.dynamic.describe()}; {v.reason}" if v.dynamic is not None else v.reason


def _shape_text(v: VariablePlan) -> str:
    """"1000x16"; a dynamic table's rows are its keys: "keysx16"."""
    if v.dynamic is not None:
        return "x".join(["keys", *map(str, v.shape[1:])])
    return "x".join(map(str, v.shape)) or "scalar"


def _shards_text(v: VariablePlan) -> str:
    """"2 @ 0,1": the shard count and the server of each shard ("... in g3": the shards of
    table group 3, which this variable shares)."""
    if not v.shards:
        return "-"
    text = f"{v.shards} @ {','.join(map(str, v.servers))}" if v.servers else str(v.shards)
    group = _GROUP_NAME.search(v.table)
    return f"{text} in {group.group(1)}" if group else text


def table_name(run_id: str, index: int, name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]", "_", name.split(":")[0]).strip("._-") or "var"
    return f"{run_id}.v{index}.{clean}"[:128]


_GROUP_NAME = re.compile(r"\.(g\d+)\.x\d+(?:\.r\d+)?$")


def group_table_name(run_id: str, first: int, members: int) -> str:
    """The server table of a table group: named by its first variable's index."""
    return f"{run_id}.g{first}.x{members}"


def _kind(info: VariableInfo) -> tuple[str, str]:
    if info.dynamic is not None:  # (the plan's table shows its bound: `_reason_text`)
        return "sparse", "a DynamicEmbedding's table, keyed by any int64"
    if not info.gather_only:
        return "dense", info.read_reason
    if info.gradient == "Tensor":
        return "dense", "gathered, but its gradient is a dense Tensor"
    return "sparse", info.read_reason + (
        "; gradient IndexedSlices" if info.gradient == "IndexedSlices" else "")


def _placement(config: PlacementOptions, info: VariableInfo, kind: str) -> tuple[str, str]:
    override = config.placement.get(info.name)
    if info.dynamic is not None:
        if config.mode == "allreduce" or override == "allreduce":
            why = ("mode is 'allreduce'" if config.mode == "allreduce" else
                   "placement names it 'allreduce'")
            raise ConfigError(f"{info.name!r} is a DynamicEmbedding table, whose rows are "
                              f"keyed by any int64 and live on the parameter servers, but "
                              f"{why}; use mode 'hybrid', 'ps' or 'async' (or drop it from "
                              f"placement)")
        return "ps", ""
    if override is not None:
        return override, f"placed on {override} by the user"
    if config.mode == "ps":
        return "ps", ""
    if config.mode == "allreduce":
        return "allreduce", ""
    return ("ps" if kind == "sparse" else "allreduce"), ""


def _shards(config: PlacementOptions, info: VariableInfo, num_servers: int) -> int:
    wanted = config.shards.get(info.name) if isinstance(config.shards, Mapping) \
        else config.shards
    if info.dynamic is not None:  # keys grow without a vocabulary: every server by default
        return max(1, num_servers if wanted is None else wanted)
    rows = info.shape[0] if info.shape else 1
    if wanted is None:
        wanted = min(num_servers, info.bytes // SHARD_MIN_BYTES)
    return max(1, min(wanted, rows))


def _wire_dtype(config: PlacementOptions, info: VariableInfo, on_ps: bool) -> str:
    """The dtype a variable's table sends its rows in, "" for its own: `config.wire_dtype`
    for every float32 table, or for the variables it names (which must be float32 tables)."""
    named = isinstance(config.wire_dtype, Mapping)
    wanted = config.wire_dtype.get(info.name) if named else config.wire_dtype
    if wanted is None or wanted == info.dtype:
        return ""
    if named and not on_ps:
        raise ConfigError(f"wire_dtype names {info.name!r}, which the plan keeps on the "
                          f"workers (all-reduced); wire_dtype applies to tables on the "
                          f"servers: remove it, or place the variable on 'ps'")
    if named and info.dtype != "float32":
        raise ConfigError(f"wire_dtype of {info.name!r} is {wanted!r}, but the variable is "
                          f"{info.dtype}; narrower rows on the wire need a float32 table")
    return wanted if on_ps and info.dtype == "float32" else ""


def _grouped(plans: list[VariablePlan], keys: Mapping[int, object], named: set[str],
             run_id: str, placed: bool = True) -> list[VariablePlan]:
    """Table groups (`PlacementOptions.group_tables`): placed variables with equal rows (width,
    dtype and wire dtype), an equal `keys` entry (the strategy's: how their initial values are made)
    and the same shards on the same servers share one server table, each at its own row
    offset, unless the user named their shard count (`named`). A step's request to a server
    then carries one part for all of them instead of one per table: a server spends ~60 us
    of Python per part whatever its rows, which made many small tables the slowest case
    (docs/benchmarks.md). Placement is what it was: a group holds what its server held.
    Not `placed` (the groups of a checkpoint, before placement): equal keys group whatever
    the shards, and the group gets its members' largest shard count."""
    by_key: dict[tuple, list[VariablePlan]] = {}
    for v in plans:
        if v.placement == "ps" and v.index in keys and v.name not in named and \
                len(v.shape) > 1 and v.dynamic is None:
            key = (math.prod(v.shape[1:]), v.dtype, v.wire_dtype, keys[v.index]) + \
                ((v.shards, v.servers) if placed else ())
            by_key.setdefault(key, []).append(v)
    grouped = {v.index: v for v in plans}
    for members in (m for m in by_key.values() if len(m) > 1):
        rows = sum(v.shape[0] for v in members)
        name = group_table_name(run_id, members[0].index, len(members))
        shards = max(v.shards for v in members)
        offset = 0
        for v in members:
            grouped[v.index] = replace(v, table=name, offset=offset, table_rows=rows,
                                       shards=shards)
            offset += v.shape[0]
    return [grouped[v.index] for v in plans]


def place_shards(variables: tuple[VariablePlan, ...], num_servers: int,
                 keep: Mapping[int, tuple[int, ...]] | None = None
                 ) -> dict[int, tuple[int, ...]]:
    """Server of every shard of the variables on parameter servers (index -> servers), by
    the one placer, `parallax.placement.planner.place`, with nothing measured yet: whole
    tables by bytes, the biggest first, each shard onto the least-loaded server its table does
    not use yet (lowest index on ties). The variables of a table group are placed as their
    one table. Deterministic: every worker computes the same placement from the same plan.
    Variables in `keep` (index -> servers) stay where they are and count as load (resharding
    some tables of a job)."""
    keep = keep or {}
    units: dict[str, list[VariablePlan]] = {}
    for v in variables:
        if v.index in keep:
            units[f"#kept{v.index}"] = [v]
        elif v.placement == "ps":
            units.setdefault(v.table or f"#{v.index}", []).append(v)
    counts = {name: len(keep[m[0].index]) if m[0].index in keep else m[0].shards
              for name, m in units.items()}
    profiles = [TableProfile(name, max(counts[name], sum(v.shape[0] if v.shape else 1
                                                         for v in m)),
                             max(1, m[0].shape[-1] if len(m[0].shape) > 1 else 1),
                             sum(v.bytes for v in m))
                for name, m in sorted(units.items(), key=lambda u: u[1][0].index)]
    kept = {name: keep[m[0].index] for name, m in units.items() if m[0].index in keep}
    plan = place(counts, profiles, ClusterProfile(max(1, num_servers), 1), keep=kept)
    return {v.index: placement.servers for placement in plan.tables
            for v in units[placement.name]}


def make_plan(config: PlacementOptions, infos: list[VariableInfo], *, run_id: str,
              num_servers: int, num_workers: int,
              group_keys: Mapping[int, object] | None = None, saved_groups: bool = False
              ) -> Plan:
    """The plan. `group_keys` (variable index -> a hashable): the variables that may share a
    server table with others of equal key and row shape, placed alike (see `_grouped`);
    none by default, and none when `config.group_tables` is off. `saved_groups`: the keys
    name whole groups (a checkpoint's), made before placement and placed as one table."""
    names = {i.name for i in infos}
    for option, given in (("placement", config.placement), ("shards", config.shards),
                          ("wire_dtype", config.wire_dtype)):
        unknown = set(given) - names if isinstance(given, Mapping) else set()
        if unknown:
            raise ConfigError(f"{option} names {sorted(unknown)} match no trainable variable; "
                              f"known: {', '.join(i.name for i in infos)}")
    plans = []
    for info in sorted(infos, key=lambda i: i.index):
        kind, reason = _kind(info)
        placement, why = _placement(config, info, kind)
        on_ps = placement == "ps"
        shards = _shards(config, info, num_servers) if on_ps else 0
        plans.append(VariablePlan(
            index=info.index, name=info.name, kind=kind, placement=placement,
            reason=f"{reason}; {why}" if why else reason, shape=info.shape, dtype=info.dtype,
            bytes=info.bytes * (shards if info.dynamic else 1), shards=shards,
            table=table_name(run_id, info.index, info.name) if on_ps else "",
            table_rows=(info.shape[0] if info.shape else 1) if on_ps else 0,
            wire_dtype=_wire_dtype(config, info, on_ps),
            dynamic=info.dynamic and info.dynamic.planned(shards)))
    grouping = bool(config.group_tables and group_keys)
    named = set(config.shards) if isinstance(config.shards, Mapping) else set()
    if grouping and saved_groups:
        plans = _grouped(plans, group_keys, named, run_id, placed=False)
    placed = place_shards(tuple(plans), num_servers)
    plans = [replace(v, servers=placed.get(v.index, ())) for v in plans]
    if grouping and not saved_groups:
        plans = _grouped(plans, group_keys, named, run_id)
    cache = config.cache.describe() if config.cache is not None else ""
    return Plan(config.mode, config.sync, num_servers, num_workers, tuple(plans), cache=cache)
