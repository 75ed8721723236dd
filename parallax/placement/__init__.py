"""Where tables go, decided without TensorFlow: the plan (sparse or dense, servers and shard
counts), capacity checks, the measured shard-count search (`planner`, `tuning`) and the
traffic model behind the benchmark's projection. What runs it during training (the tuner,
live resharding) is TensorFlow-side, in `parallax.tf`.
"""
