"""One benchmark process: `python -m parallax.bench.worker --system S --workload W ...`.

The harness starts one per worker (and, for TF's ParameterServerStrategy, one per TF server
and one coordinator) with its role in the environment:
- parallax modes and Horovod: Horovod's gloo variables (rank, size, rendezvous), and for
  parallax PARALLAX_PS_ADDRESSES / PARALLAX_RUN_ID;
- TensorFlow's strategies: TF_CONFIG.
Every system trains the same `models.BenchModel` on the same batches with Keras' SGD,
each worker on its own local batch; rank 0 prints one BENCH_RESULT line.

Row cache (`parallax bench --cache-staleness 0,4`): `--cache-staleness S --cache-mb M` give a
parallax system's strategy `cache=parallax.RowCache(M << 20, S)`. Rank 0 of a parallax system
reports, over the timed windows, the servers' pull counters (rows, bytes and requests of
every worker's pulls, from their Stats) and its own cache's counts (`counters`), and every
step's loss (`losses`).

Partition benchmark (`parallax bench partitions`), parallax systems only: `--shards N` gives
every sparse table N shards (capped by its rows); `--search-partitions` lets the strategy's
partition search (`parallax.PartitionSearch`) choose them: the run steps until the search is
done (at most --search-max-steps), then times its windows at the chosen plan. Rank 0 then also
prints BENCH_TUNING (the search's report, once decided) and BENCH_PLAN (the shard count and
servers of every table as measured). Without --search-partitions the search is off (the
strategy's "auto" would otherwise search during the timed windows at 2+ workers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

from parallax.bench import measure, models, workloads  # noqa: E402

PARALLAX_SYSTEMS = ("hybrid", "ps", "allreduce", "hybrid_tf")  # hybrid_tf: TF's collectives
HOROVOD_SYSTEMS = ("horovod", "horovod_dense")
TF_SYSTEMS = ("mwms", "tf_ps")
SYSTEMS = PARALLAX_SYSTEMS + TF_SYSTEMS + HOROVOD_SYSTEMS
TUNING_PREFIX = "BENCH_TUNING "
PLAN_PREFIX = "BENCH_PLAN "
SEARCH_CHECK_EVERY = 5  # steps between the workers' checks that the search is done


def _iterator(spec: workloads.WorkloadSpec, rank: int):
    return iter(models.dataset(spec, rank))


def parallax_trainer(system: str, spec: workloads.WorkloadSpec, shards: int | None = None,
                     search=None, cache=None) -> measure.Trainer:
    return _parallax_setup(system, spec, shards, search, cache)[0]


def _parallax_setup(system: str, spec: workloads.WorkloadSpec, shards: int | None, search,
                    cache=None):
    """(trainer, strategy): with `shards` shards per table (else the default plan), searched
    by `search` (a parallax.PartitionSearch) when given, with the row cache `cache` (a
    parallax.RowCache) when given."""
    import keras
    import tensorflow as tf

    import parallax

    # No partition search unless asked for: the strategy's default ("auto") would search
    # while the windows are timed, so the comparison measures the default (or --shards) plan;
    # `parallax bench partitions` measures the search itself.
    options: dict = {"search_partitions": search if search is not None else False}
    if shards is not None:
        options["shards"] = shards
    if cache is not None:
        options["cache"] = cache
    tf_collectives = system.endswith("_tf")
    strategy = parallax.ParallaxStrategy(mode=system.removesuffix("_tf"), sync=True,
                                         log_plan=False, **options,
                                         **({"collectives": "tensorflow"} if tf_collectives
                                            else {}))
    with strategy.scope():
        model = models.BenchModel(spec)
        optimizer = keras.optimizers.SGD(learning_rate=spec.lr)
    step_fn = models.train_fn(model, optimizer, 1.0 / strategy.num_replicas_in_sync)
    rank, workers = strategy.worker.rank, strategy.worker.size
    batches = _iterator(spec, rank)
    losses: list[float] = []

    @tf.function
    def train(batch):
        return strategy.run(step_fn, args=(batch,))

    def step():
        losses.append(float(train(next(batches))))

    def sync():  # a window ends when its last step's pushes have landed
        for table in strategy.tables.values():
            table.wait_for_pushes()

    trainer = measure.Trainer(step=step, rank=rank, workers=workers,
                              global_batch=spec.batch_per_worker * workers,
                              agree_max=(_agreed_max(strategy) if tf_collectives
                                         else _horovod_max),
                              sync=sync, loss=lambda: losses[-1] if losses else float("nan"),
                              losses=lambda: losses, counters=lambda: pull_counters(strategy))
    return trainer, strategy


PULL_METHODS = ("Pull", "PullMany")  # the servers' methods that answer rows to workers
CACHE_COUNTS = ("pulls", "hits", "misses", "stale", "requests_saved", "bytes_saved")


def pull_counters(strategy) -> dict[str, float]:
    """What the job's servers answered to pulls so far (rows, bytes, requests; every
    worker's, from their Stats) and, with a row cache, this worker's cache's counts."""
    out = {"server_pull_rows": 0, "server_pull_bytes": 0, "server_pull_requests": 0}
    plan = strategy.plan
    names = sorted({v.table for v in plan.on_servers}) if plan is not None else []
    if names:
        for reply in strategy.extended.client.stats(names).values():
            for table in reply.tables:
                for method in (m for m in table.methods if m.method in PULL_METHODS):
                    out["server_pull_rows"] += method.rows
                    out["server_pull_bytes"] += method.bytes
                    out["server_pull_requests"] += method.requests
    stats = strategy.cache_stats()
    if stats is not None:
        out.update({f"cache_{name}": getattr(stats, name) for name in CACHE_COUNTS})
    return out


def partition_search(args: argparse.Namespace):
    """The parallax.PartitionSearch the flags ask for (only the keywords given)."""
    import parallax
    cls = getattr(parallax, "PartitionSearch", None)
    if cls is None:
        raise SystemExit("parallax.bench.worker: --search-partitions needs "
                         "parallax.PartitionSearch, which this parallax does not have")
    options = {key: value for key, value in (
        ("min_shards", args.search_min_shards), ("max_shards", args.search_max_shards),
        ("steps_per_sample", args.search_steps_per_sample),
        ("warmup_steps", args.search_warmup_steps), ("cache_dir", args.search_cache_dir))
        if value is not None}
    return cls(**options)


def run_search(trainer: measure.Trainer, strategy, max_steps: int) -> dict:
    """Step until the partition search has decided, on every worker alike (they agree every
    SEARCH_CHECK_EVERY steps, so all run the same steps); its report, plus the steps run."""
    import time
    started, steps = time.time(), 0
    while True:
        for _ in range(SEARCH_CHECK_EVERY):
            trainer.step()
        steps += SEARCH_CHECK_EVERY
        search = strategy.partition_search
        if search is None:
            raise SystemExit("parallax.bench.worker: --search-partitions was given but "
                             "strategy.partition_search is None")
        if not trainer.agree_max(0.0 if search.done else 1.0):
            break
        if steps >= max_steps:
            raise SystemExit(f"parallax.bench.worker: the partition search was not done after "
                             f"{steps} steps (--search-max-steps {max_steps})")
    trainer.sync()
    report = dict(search.report())
    report["bench_steps"], report["bench_seconds"] = steps, time.time() - started
    return report


def plan_record(strategy) -> dict:
    """Shard count and servers of every table in the plan as it is now."""
    plan = strategy.plan
    tables = plan.on_servers if plan is not None else ()
    return {"shards": {v.name: v.shards for v in tables},
            "servers": {v.name: list(v.servers) for v in tables}}


def _horovod_max(value: float) -> float:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    if not hvd.is_initialized() or hvd.size() == 1:  # parallax alone does not start Horovod
        return value
    return float(hvd.allreduce(tf.constant(value, tf.float64), op=hvd.Max, name="bench_max"))


def _agreed_max(strategy):
    """The workers' maximum of a value through the strategy's own collectives."""
    return lambda value: max(strategy.extended.workers.allgather_object(float(value)))


def horovod_trainer(system: str, spec: workloads.WorkloadSpec) -> measure.Trainer:
    """Horovod alone: every variable replicated, gradients averaged by
    DistributedGradientTape (sparse ones all-gathered, or densified with sparse_as_dense)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    model = models.BenchModel(spec)
    optimizer = keras.optimizers.SGD(learning_rate=spec.lr)
    variables = model.trainable_variables
    batches = _iterator(spec, hvd.rank())
    last = {"loss": float("nan")}
    sparse_as_dense = system == "horovod_dense"

    @tf.function
    def train(batch):
        with tf.GradientTape() as tape:
            loss = model.loss(batch)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    def step():
        last["loss"] = float(train(next(batches)))

    return measure.Trainer(step=step, rank=hvd.rank(), workers=hvd.size(),
                           global_batch=spec.batch_per_worker * hvd.size(),
                           agree_max=_horovod_max, loss=lambda: last["loss"])


def trainer_for(system: str, spec: workloads.WorkloadSpec) -> measure.Trainer:
    if system in PARALLAX_SYSTEMS:
        return parallax_trainer(system, spec)
    if system in HOROVOD_SYSTEMS:
        return horovod_trainer(system, spec)
    from parallax.bench import tf_peers
    return tf_peers.trainer(system, spec)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parallax.bench.worker")
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--workload", choices=workloads.WORKLOADS, required=True)
    parser.add_argument("--size", choices=workloads.SIZES, default="full")
    parser.add_argument("--data-batches", type=_positive, default=workloads.POOL_BATCHES,
                        help="batches each worker makes before timing and cycles")
    parser.add_argument("--role", choices=("worker", "ps", "chief"), default="worker",
                        help="tf_ps only: a TF server (worker, ps) or the coordinator (chief)")
    defaults = measure.WindowConfig()
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--calibration-steps", type=int, default=defaults.calibration_steps)
    parser.add_argument("--windows", type=int, default=defaults.windows)
    parser.add_argument("--window-seconds", type=float, default=defaults.window_seconds)
    parser.add_argument("--min-window-steps", type=int, default=defaults.min_window_steps)
    parser.add_argument("--shards", type=_positive, default=None,
                        help="parallax systems: shards of every sparse table (capped by rows)")
    parser.add_argument("--search-partitions", action="store_true",
                        help="parallax systems: the strategy's partition search picks shard "
                             "counts; windows are timed once it is done")
    parser.add_argument("--search-max-steps", type=_positive, default=2000,
                        help="fail if the search has not decided after this many steps")
    for name in ("min-shards", "max-shards", "steps-per-sample", "warmup-steps"):
        parser.add_argument(f"--search-{name}", type=_positive, default=None,
                            help="passed to parallax.PartitionSearch (its default if unset)")
    parser.add_argument("--cache-staleness", type=_non_negative, default=None,
                        help="parallax systems: a worker row cache serving rows at most this "
                             "many steps stale (parallax.RowCache); none if unset")
    parser.add_argument("--cache-mb", type=_positive, default=64,
                        help="the row cache's memory per worker, MiB (with --cache-staleness)")
    parser.add_argument("--search-cache-dir", default=None,
                        help="PartitionSearch.cache_dir: where decisions are kept and reused "
                             "('' keeps none, so the search always runs; default: the tuner's)")
    return parser


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.system == "tf_ps" and args.role != "chief":
        from parallax.bench import tf_peers
        return tf_peers.serve(args.role)
    spec = replace(workloads.get(args.workload, args.size), data_batches=args.data_batches)
    partitioned = args.shards is not None or args.search_partitions
    cached = args.cache_staleness is not None
    if (partitioned or cached) and args.system not in PARALLAX_SYSTEMS:
        raise SystemExit(f"parallax.bench.worker: --shards, --search-partitions and "
                         f"--cache-staleness apply to {', '.join(PARALLAX_SYSTEMS)}, not "
                         f"{args.system}")
    strategy = None
    if partitioned or cached or args.system in PARALLAX_SYSTEMS:
        search = partition_search(args) if args.search_partitions else None
        trainer, strategy = _parallax_setup(args.system, spec, args.shards, search,
                                            _row_cache(args))
    else:
        trainer = trainer_for(args.system, spec)
    config = measure.WindowConfig(args.warmup_steps, args.calibration_steps, args.windows,
                                  args.window_seconds, args.min_window_steps)
    counted: dict[str, float] = {}
    try:
        if args.search_partitions:
            report = run_search(trainer, strategy, args.search_max_steps)
            if trainer.rank == 0:
                print(TUNING_PREFIX + json.dumps(report, default=str), flush=True)
        gate = os.environ.get(measure.GATE_ENV)
        windows = measure.run_windows(trainer, config, counted if trainer.rank == 0 else None,
                                      lambda: measure.wait_for_gate(gate))
        if trainer.rank == 0:
            if partitioned:
                print(PLAN_PREFIX + json.dumps(plan_record(strategy)), flush=True)
            measure.emit(args.system, args.workload, trainer, windows, counted=counted,
                         data_path=_data_path(strategy))
    finally:
        trainer.close()
    return 0


def _data_path(strategy) -> str | None:
    """parallax's data path in this process (compiled or numpy); None for other systems."""
    if strategy is None:
        return None
    from parallax import native
    return native.describe()


def _row_cache(args: argparse.Namespace):
    if args.cache_staleness is None:
        return None
    import parallax
    return parallax.RowCache(args.cache_mb << 20, args.cache_staleness)


def parse_line(prefix: str, line: str) -> dict | None:
    """The record of a `prefix` line (TUNING_PREFIX, PLAN_PREFIX), or None for another line."""
    marker = line.find(prefix)
    return None if marker < 0 else json.loads(line[marker + len(prefix):])


if __name__ == "__main__":
    sys.exit(main())
