"""The test tiers (Horovod's single / parallel / integration split, by marker), one place.

- `unit`: no TensorFlow, no process, no socket server: seconds (`make test-fast`). When a
  run selects only unit tests, importing TensorFlow or starting a process fails the test.
- `server`: real parameter-server processes on loopback, driven by the client; no TensorFlow.
- `tf`: TensorFlow in this process (the strategy, Keras), usually with real servers.
- `parallel`: several worker processes (`parallax run`, horovodrun) or the benchmark's
  namespaces and cgroups.
- `integration`: the command line end to end, containers and manifests, chaos.

`make test` runs every tier. Every test file is listed here once: a new file picks its tier.

Time: each test has a limit (pytest-timeout: pyproject.toml's default, `TIMEOUT_S` for a
tier, `@pytest.mark.timeout(S)` for a long test), and each tier a budget (`BUDGET_S`: the sum
of its tests' durations in a run of the whole tier; tests/tier_budget.py checks it).
"""
from __future__ import annotations

TIERS = {
    "unit": ["test_layout.py", "test_packed_codec.py", "test_plan.py", "test_routing_runs.py",
             "test_row_cache.py",
             "test_traffic_model.py", "test_bench_report.py", "test_planner.py",
             "test_bulk_codec.py", "test_cli_help.py", "test_wire_dtypes.py",
             "test_dynamic_vocab.py", "test_native.py",
             "test_native_server.py", "test_native_server_steps.py", "test_docs.py",
             "test_client_retries.py", "test_worker_metrics.py", "test_cpu_quota.py",
             "test_k8s_jobset.py"],
    "server": ["test_bad_input.py", "test_checkpoint.py", "test_checkpoint_safety.py",
               "test_dataplane.py", "test_fuzz.py", "test_hardening.py", "test_load.py",
               "test_multi_table.py", "test_native_worker.py", "test_reshard.py",
               "test_server.py",
               "test_server_limits.py", "test_memory_bound.py", "test_server_process.py", "test_units.py",
               "test_wire_contract.py", "test_security.py", "test_wire_compression.py",
               "test_dynamic_server.py", "test_dynamic_rows.py"],
    "tf": ["test_analysis.py", "test_capacity.py", "test_fusion.py", "test_optimizer_math.py",
           "test_remote.py", "test_resume.py", "test_embedded_resume.py", "test_strategy.py", "test_strategy_memory.py", "test_tuning.py",
           "test_strategy_wire.py", "test_row_cache_training.py", "test_dynamic_embedding.py"],
    "parallel": ["test_strategy_equivalence.py", "test_multiprocess.py", "test_multihost.py",
                 "test_launch.py", "test_launcher_edges.py", "test_orphans.py",
                 "test_bench_cgroups.py", "test_bench_netns.py", "test_bench_harness.py",
                 "test_bench_peers.py", "test_bench_partitions.py", "test_environment.py",
                 "test_hosts.py", "test_tf_collectives.py", "test_row_cache_workers.py",
                 "test_keras_traps.py", "test_cpu_quota_process.py"],
    "integration": ["test_examples.py", "test_migration.py", "test_deploy.py", "test_chaos.py",
                    "test_observability.py", "test_logs.py", "test_restarts.py",
                    "test_tiers.py", "test_k8s_security.py"],
}
TIER_OF = {name: tier for tier, names in TIERS.items() for name in names}

# Seconds a whole tier's tests may take together (setup, call and teardown, as --durations
# counts them); `make test` fails past it, naming the tier's slowest tests. Each is at least
# 1.5x the time measured on this project's 2-core machine shared with other jobs (load
# average 6-27, 2026-12-03; the README's Tests has the figures): a loaded CI machine must
# not fail on them. A tier that grows for good raises its budget here, with its new figure.
# PARALLAX_TIER_BUDGET=off or a factor relaxes them all.
BUDGET_S = {"unit": 120, "server": 450, "tf": 1100, "parallel": 4200, "integration": 2100}
# A tier's own limit per test, where pyproject.toml's default (300 s) does not fit it: a unit
# test takes milliseconds; a parallel one may run several multi-worker jobs in a module
# fixture, which the first test to need it pays for (test_strategy_equivalence's, 660 s on
# a loaded machine, has 1800 s of its own).
TIMEOUT_S = {"unit": 60, "parallel": 900}
GUARDED = ("tensorflow", "keras", "horovod")  # what a unit-only run may not import


def files(tier: str) -> list[str]:
    """The test files of `tier`, as paths from the repository root."""
    return [f"tests/{name}" for name in TIERS[tier]]


if __name__ == "__main__":  # `python tests/tiers.py unit`: the files of a tier, for pytest
    import sys
    print(" ".join(files(sys.argv[1])))
