"""A worker's own metrics (`parallax.client.worker_metrics`) without processes or sockets: the
families a scrape would read, their names, types and labels, fed the way a step feeds
them; and the environment contract `parallax run --metrics-port` passes them by.
(tests/integration/test_observability.py serves them over HTTP and scrapes a 2-worker job.)"""
from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from parallax.client.connection import ServerConnection
from parallax.client.row_cache import CacheStats
from parallax.client.table import ShardedTable
from parallax.client.worker_metrics import WorkerMetrics
from parallax.env import (WORKER_METRICS_PORT_ENV, parse_worker_metrics_line,
                          worker_metrics_line, worker_metrics_port)
from parallax.errors import ConfigError
from parallax.protocol.specs import TableSpec


def _table(name: str, dim: int, wire_dtype: str = "") -> ShardedTable:
    """A table as a plan makes it (its channel is never used: nothing is sent)."""
    return ShardedTable(TableSpec(name=name, vocabulary_size=100, dim=dim, shard_count=1,
                                  wire_dtype=wire_dtype), [ServerConnection("127.0.0.1:1")])


def _scraped(metrics: WorkerMetrics) -> dict:
    """{family name: family} as a scraper parses the text exposition."""
    class Families:
        def collect(self):
            return metrics.families()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _fed() -> WorkerMetrics:
    metrics = WorkerMetrics()
    emb, users = _table("1203-ab.v3.embedding", 8), _table("mine", 4, "float16")
    for _ in range(3):  # three steps: a pull and a push each
        metrics.moved("in", [emb, users], [5, 2])
        metrics.observe("pull", 0.004)
        metrics.moved("out", [emb, users], [5, 0])  # users' push sent no rows
        metrics.observe("push", 0.002)
        metrics.step(0.05)
    metrics.step(None)  # a step without a fused pull: counted, not timed
    return metrics


def test_names_types_and_units_follow_the_servers_conventions():
    families = _scraped(_fed())
    assert {name: f.type for name, f in families.items()} == {
        "parallax_worker_steps": "counter", "parallax_worker_step_seconds": "histogram",
        "parallax_worker_pull_seconds": "histogram",
        "parallax_worker_push_seconds": "histogram", "parallax_worker_rows": "counter",
        "parallax_worker_bytes": "counter"}
    steps = families["parallax_worker_steps"].samples
    assert [(s.name, s.value) for s in steps] == [("parallax_worker_steps_total", 4.0)]
    step = {s.name: s.value for s in families["parallax_worker_step_seconds"].samples
            if s.name != "parallax_worker_step_seconds_bucket"}
    assert step == {"parallax_worker_step_seconds_count": 3.0,
                    "parallax_worker_step_seconds_sum": pytest.approx(0.15)}
    pull = {s.labels["le"]: s.value for s in families["parallax_worker_pull_seconds"].samples
            if s.name.endswith("_bucket")}
    assert pull["0.0025"] == 0 and pull["0.005"] == 3 and pull["+Inf"] == 3


def test_rows_and_bytes_carry_run_id_and_table_apart_and_the_wire_dtype():
    samples = {(s.name, s.labels["direction"], s.labels["run_id"], s.labels["table"]): s.value
               for name in ("parallax_worker_rows", "parallax_worker_bytes")
               for s in _scraped(_fed())[name].samples}
    assert samples == {
        ("parallax_worker_rows_total", "in", "1203-ab", "v3.embedding"): 15,
        ("parallax_worker_rows_total", "out", "1203-ab", "v3.embedding"): 15,
        ("parallax_worker_rows_total", "in", "", "mine"): 6,
        ("parallax_worker_bytes_total", "in", "1203-ab", "v3.embedding"): 15 * 8 * 4,
        ("parallax_worker_bytes_total", "out", "1203-ab", "v3.embedding"): 15 * 8 * 4,
        ("parallax_worker_bytes_total", "in", "", "mine"): 6 * 4 * 2}  # float16 on the wire


def test_rank_and_the_row_cache_appear_once_known():
    metrics = _fed()
    metrics.rank, metrics.size = 1, 2
    metrics.cache_stats = lambda: CacheStats(hits=7, misses=3, stale=1)
    families = _scraped(metrics)
    values = {s.name: s.value for name in ("parallax_worker_rank", "parallax_worker_size",
                                           "parallax_worker_row_cache_hits",
                                           "parallax_worker_row_cache_misses",
                                           "parallax_worker_row_cache_stale")
              for s in families[name].samples}
    assert values == {"parallax_worker_rank": 1, "parallax_worker_size": 2,
                      "parallax_worker_row_cache_hits_total": 7,
                      "parallax_worker_row_cache_misses_total": 3,
                      "parallax_worker_row_cache_stale_total": 1}
    metrics.cache_stats = lambda: None  # the strategy has no cache
    assert not any("row_cache" in name for name in _scraped(metrics))


def test_the_launchers_contract_port_and_line():
    assert worker_metrics_port({}) is None and worker_metrics_port(
        {WORKER_METRICS_PORT_ENV: " "}) is None
    assert worker_metrics_port({WORKER_METRICS_PORT_ENV: "0"}) == 0
    assert worker_metrics_port({WORKER_METRICS_PORT_ENV: "9102"}) == 9102
    for bad in ("-1", "70000", "x"):
        with pytest.raises(ConfigError, match=f"{WORKER_METRICS_PORT_ENV}='{bad}' must be 0"):
            worker_metrics_port({WORKER_METRICS_PORT_ENV: bad})
    line = worker_metrics_line(3, "127.0.0.1:9105")
    assert parse_worker_metrics_line(line) == (3, "127.0.0.1:9105")
    assert parse_worker_metrics_line(f"[3]<stderr>:{line}") == (3, "127.0.0.1:9105")
    assert parse_worker_metrics_line("PARALLAX_WORKER_METRICS rank=x address=h:1") is None
    assert parse_worker_metrics_line("epoch 1/3") is None


def test_no_per_row_work_on_the_hot_path():
    """A step's counting is per table, whatever its rows: a million rows cost what one does."""
    metrics, table = WorkerMetrics(), _table("t", 4)
    metrics.moved("in", [table], [np.int64(1_000_000)])
    assert _scraped(metrics)["parallax_worker_rows"].samples[0].value == 1_000_000
