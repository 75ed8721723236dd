"""Where tables go: the plan (sparse or dense, servers and shard counts), capacity checks,
the measured partition search (`partitioner`, `tuning`, `tuner`), live resharding and the
traffic model behind the benchmark's projection.
"""
