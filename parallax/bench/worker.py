"""One benchmark process: `python -m parallax.bench.worker --system S --workload W ...`.

The harness starts one per worker (and, for TF's ParameterServerStrategy, one per TF server
and one coordinator) with its role in the environment:
- parallax modes and Horovod: Horovod's gloo variables (rank, size, rendezvous), and for
  parallax PARALLAX_PS_ADDRESSES / PARALLAX_RUN_ID;
- TensorFlow's strategies: TF_CONFIG.
Every system trains the same `workloads.BenchModel` on the same batches with Keras' SGD,
each worker on its own local batch; rank 0 prints one BENCH_RESULT line.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported

from parallax.bench import measure, workloads  # noqa: E402

PARALLAX_SYSTEMS = ("hybrid", "ps", "allreduce")
HOROVOD_SYSTEMS = ("horovod", "horovod_dense")
TF_SYSTEMS = ("mwms", "tf_ps")
SYSTEMS = PARALLAX_SYSTEMS + TF_SYSTEMS + HOROVOD_SYSTEMS


def _iterator(spec: workloads.WorkloadSpec, rank: int):
    return iter(workloads.dataset(spec, rank))


def _train_fn(model, optimizer, scale: float):
    """The per-replica step shared by the strategies: loss scaled by 1/replicas because
    tf.distribute sums gradients across replicas (the Keras and MWMS convention)."""
    import tensorflow as tf

    def step_fn(batch):
        with tf.GradientTape() as tape:
            loss = model.loss(batch)
            scaled = loss * scale
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step_fn


def parallax_trainer(system: str, spec: workloads.WorkloadSpec) -> measure.Trainer:
    import keras
    import tensorflow as tf

    import parallax

    strategy = parallax.ParallaxStrategy(mode=system, sync=True, log_plan=False)
    with strategy.scope():
        model = workloads.BenchModel(spec)
        optimizer = keras.optimizers.SGD(learning_rate=spec.lr)
    step_fn = _train_fn(model, optimizer, 1.0 / strategy.num_replicas_in_sync)
    rank, workers = strategy.worker.rank, strategy.worker.size
    batches = _iterator(spec, rank)
    last = {"loss": float("nan")}

    @tf.function
    def train(batch):
        return strategy.run(step_fn, args=(batch,))

    def step():
        last["loss"] = float(train(next(batches)))

    def sync():  # a window ends when its last step's pushes have landed
        for table in strategy.tables.values():
            table.wait_for_pushes()

    return measure.Trainer(step=step, rank=rank, workers=workers,
                           global_batch=spec.batch_per_worker * workers,
                           agree_max=_horovod_max, sync=sync, loss=lambda: last["loss"])


def _horovod_max(value: float) -> float:
    import horovod.tensorflow as hvd
    import tensorflow as tf
    if not hvd.is_initialized() or hvd.size() == 1:  # parallax alone does not start Horovod
        return value
    return float(hvd.allreduce(tf.constant(value, tf.float64), op=hvd.Max, name="bench_max"))


def horovod_trainer(system: str, spec: workloads.WorkloadSpec) -> measure.Trainer:
    """Horovod alone: every variable replicated, gradients averaged by
    DistributedGradientTape (sparse ones all-gathered, or densified with sparse_as_dense)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    model = workloads.BenchModel(spec)
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
    parser.add_argument("--role", choices=("worker", "ps", "chief"), default="worker",
                        help="tf_ps only: a TF server (worker, ps) or the coordinator (chief)")
    defaults = measure.WindowConfig()
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--calibration-steps", type=int, default=defaults.calibration_steps)
    parser.add_argument("--windows", type=int, default=defaults.windows)
    parser.add_argument("--window-seconds", type=float, default=defaults.window_seconds)
    parser.add_argument("--min-window-steps", type=int, default=defaults.min_window_steps)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.system == "tf_ps" and args.role != "chief":
        from parallax.bench import tf_peers
        return tf_peers.serve(args.role)
    spec = workloads.get(args.workload, args.size)
    trainer = trainer_for(args.system, spec)
    config = measure.WindowConfig(args.warmup_steps, args.calibration_steps, args.windows,
                                  args.window_seconds, args.min_window_steps)
    try:
        windows = measure.run_windows(trainer, config)
        if trainer.rank == 0:
            measure.emit(args.system, args.workload, trainer, windows)
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
