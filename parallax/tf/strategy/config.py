"""`StrategyConfig`: everything the user can choose of a `ParallaxStrategy` (what its
constructor checked and resolved from the environment), checked when made.

What the plan is made of among them is the placement's own value,
`parallax.placement.plan.PlacementOptions` (`StrategyConfig.placement_options`): the
placement layer decides without the strategy (tests/unit/test_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from parallax.env import COLLECTIVES
from parallax.errors import ConfigError
from parallax.placement.plan import PlacementOptions, is_count


@dataclass(frozen=True)
class StrategyConfig:
    """Everything the user can choose; the defaults train synchronously in hybrid mode.

    Raises:
        ConfigError: an option out of range (when made): those of the plan as
            `PlacementOptions` checks them, then `collectives`, `embedded_servers` and
            `checkpoints_kept`.
    """

    mode: str = "hybrid"
    sync: bool = True
    ps_addresses: tuple[str, ...] | None = None
    run_id: str | None = None
    embedded_servers: int = 2
    local_aggregation: bool = False
    placement: Mapping[str, str] = field(default_factory=dict)  # variable name -> ps|allreduce
    shards: int | Mapping[str, int] | None = None  # default: one per 16 MiB, <= servers
    log_plan: bool = True
    fuse: bool = True  # one pull and one push op per traced step (parallax.tf.graph.fusion)
    group_tables: bool = True  # same-shaped sparse variables share a server table
    #                            (parallax.placement.plan.make_plan)
    checkpoints_kept: int = 5  # the servers' table checkpoints kept per job
    #                            (parallax.tf.state.resume)
    collectives: str = "auto"  # what sums dense gradients: auto|horovod|tensorflow (env.py)
    # rows of server tables on the wire: one dtype for every float32 table, or variable
    # name -> dtype; None: each table's own (parallax.protocol.wire_dtypes)
    wire_dtype: str | Mapping[str, str] | None = None
    cache: object = None  # a parallax.RowCache (the worker's hot-row cache), or None: off
    # what the plan is made of (`make_plan`, `tuning.resolve`): derived, checked when made
    placement_options: PlacementOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement_options", PlacementOptions(
            mode=self.mode, sync=self.sync, placement=self.placement, shards=self.shards,
            group_tables=self.group_tables, wire_dtype=self.wire_dtype, cache=self.cache))
        if self.collectives not in COLLECTIVES:
            raise ConfigError(f"collectives {self.collectives!r} is not one of "
                              f"{', '.join(COLLECTIVES)}")
        if not is_count(self.embedded_servers):
            raise ConfigError(f"embedded_servers must be an int >= 1, got "
                              f"{self.embedded_servers!r}")
        if not is_count(self.checkpoints_kept):
            raise ConfigError(f"checkpoints_kept must be an int >= 1 (the servers' table "
                              f"checkpoints kept), got {self.checkpoints_kept!r}")
