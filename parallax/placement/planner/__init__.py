"""The shard-count tuner: per sparse table, how many shards and on which servers.

Pure Python (numpy, no TensorFlow), torchrec-style, one role per module: `types` (value
types and `PlannerError`), `enumerators` (allowed counts), `estimators` (every cost),
`proposers` (what to try), `placer` (shards onto servers) and `planners` (all of it, cached).
"""
from parallax.placement.planner.enumerators import ShardCountEnumerator
from parallax.placement.planner.estimators import (ServerLoadEstimator, StepTimeEstimator,
                                                   bytes_per_shard, prior_cost,
                                                   requests_per_step, shard_access_shares,
                                                   shard_bytes)
from parallax.placement.planner.placer import place
from parallax.placement.planner.planners import DEFAULT_PROPOSERS, PartitionPlanner, fit_report
from parallax.placement.planner.proposers import (GreedyProposer, GridProposer,
                                                  ModelFitProposer, Proposer)
from parallax.placement.planner.types import (ClusterProfile, CostPrior, FitPoint, Measurement,
                                              PartitionPlan, PlannerError, TableCost,
                                              TablePlacement, TableProfile)

__all__ = ["ClusterProfile", "CostPrior", "DEFAULT_PROPOSERS", "FitPoint", "GreedyProposer",
           "GridProposer", "Measurement", "ModelFitProposer", "PartitionPlan", "PartitionPlanner",
           "PlannerError", "Proposer", "ServerLoadEstimator", "ShardCountEnumerator",
           "StepTimeEstimator", "TableCost", "TablePlacement", "TableProfile",
           "bytes_per_shard", "fit_report", "place", "prior_cost", "requests_per_step",
           "shard_access_shares", "shard_bytes"]
