"""A worker's steady-state memory does not grow with the size of the tables it trains, nor with
the keys a dynamic table (DynamicEmbedding) holds."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "rss_worker.py"


def _steady_rss(*args) -> tuple[int, int]:
    proc = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RSS_MB"))
    fields = line.split()
    return int(fields[1]), int(fields[3])


@pytest.mark.multiprocess
def test_worker_rss_within_15_percent_when_the_vocabulary_grows_tenfold():
    small_rss, small_table = _steady_rss(200_000)
    large_rss, large_table = _steady_rss(2_000_000)
    print(f"worker RSS: {small_rss} MB with a {small_table} MB table, "
          f"{large_rss} MB with a {large_table} MB table")
    assert large_table >= 10 * small_table - 1
    assert large_rss <= 1.15 * small_rss, (small_rss, large_rss)
    # The worker does not even hold one copy of the large table.
    assert large_rss - small_rss < large_table / 2


@pytest.mark.multiprocess
def test_worker_rss_stays_flat_when_a_dynamic_tables_keys_grow_tenfold():
    """The embedded servers hold every key's row (and Adagrad slot); the worker holds none."""
    small_rss, small_table = _steady_rss("dynamic", 60_000)
    large_rss, large_table = _steady_rss("dynamic", 600_000)
    print(f"worker RSS: {small_rss} MB with {small_table} MB of rows on the servers, "
          f"{large_rss} MB with {large_table} MB")
    assert large_table >= 9 * small_table
    assert large_rss <= 1.15 * small_rss, (small_rss, large_rss)
    assert large_rss - small_rss < large_table / 4
