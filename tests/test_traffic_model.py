"""The analytic data-transfer model the benchmarks compare measured traffic against."""
from __future__ import annotations

import pytest

from parallax.errors import ConfigError
from parallax.traffic_model import StepTraffic, Workload, expected_traffic

# One table of 100 rows x dim 4 (16-byte rows + 8-byte ids), 10 unique rows per worker-step,
# and 1000 bytes of dense variables.
ONE_TABLE = dict(dense_bytes=1000, table_rows=(100,), table_dims=(4,), unique_rows=(10,))


@pytest.mark.parametrize("system, workers, sent", [
    ("hybrid", 1, 240.0),                       # pulls and pushes only: nothing to all-reduce
    ("hybrid", 2, 240 + 1000.0),                # + 2 (W-1)/W x dense
    ("hybrid", 4, 240 + 1500.0),
    ("ps", 4, 240 + 1000.0),                    # dense pulled and pushed whole
    ("allreduce", 4, 3 * 240 + 1500.0),         # the other 3 workers' rows, forwarded
    ("horovod_sparse_as_dense", 2, 1000 + 1600.0),  # the whole table densified
    ("mwms", 4, 3 * 240 + 1500.0),              # TF all-gathers IndexedSlices too
])
def test_expected_bytes_per_worker_per_step(system, workers, sent):
    traffic = expected_traffic(system, Workload(workers=workers, **ONE_TABLE))
    assert traffic == StepTraffic(sent=sent, received=sent)
    assert traffic.total == 2 * sent


def test_several_tables_add_up():
    two = Workload(workers=2, dense_bytes=0, table_rows=(100, 50), table_dims=(4, 8),
                   unique_rows=(10, 5), itemsize=4)
    assert expected_traffic("hybrid", two).sent == 10 * (16 + 8) + 5 * (32 + 8)


@pytest.mark.parametrize("kwargs, words", [
    (dict(workers=0, dense_bytes=0), "workers must be >= 1"),
    (dict(workers=1, dense_bytes=0, table_rows=(10,), table_dims=(), unique_rows=(1,)),
     "one entry per table"),
    (dict(workers=1, dense_bytes=0, table_rows=(10,), table_dims=(4,), unique_rows=(11,)),
     r"unique rows per step 11 must be in \[0, 10\]"),
])
def test_bad_workloads_are_named(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        Workload(**kwargs)


def test_unknown_system_is_named():
    with pytest.raises(ConfigError, match="'gossip' is not one of"):
        expected_traffic("gossip", Workload(workers=2, **ONE_TABLE))
