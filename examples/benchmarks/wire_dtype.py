"""Rows on the wire as float32, bfloat16 and float16 (`ParallaxStrategy(wire_dtype=...)`), side
by side in one run: row bytes per step (from the servers' stats), step throughput, and the
loss of the `lm` benchmark workload (parallax.bench) against float32's, step by step.

One process with 2 local `parallax server` processes; one strategy (its own run id, so its
own tables) per wire dtype, each training the same model from the same initial values on the
same batches. Rounds alternate the dtypes (float32, bfloat16, float16, float32, ...), so a
machine's drift hits each alike; throughput is the median over rounds. It prints a table and
writes bench-results/wire_dtype.json.

    PYTHONPATH=.:servers .venv/bin/python examples/benchmarks/wire_dtype.py \
        [--rounds 5] [--steps 40] [--vocab 100000] [--batch 256]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
ROW_METHODS = ("Pull", "Push", "PullMany", "PushMany")


def _row_bytes(client, run_id: str) -> int:
    """Row bytes the servers moved for this run's tables so far (pulls and pushes)."""
    total = 0
    for reply in client.stats().values():
        for table in reply.tables:
            if table.table.startswith(run_id + "."):
                total += sum(m.bytes for m in table.methods if m.method in ROW_METHODS)
    return total


def _setup(spec, dtype: str, addresses, run_id: str):
    import keras
    import tensorflow as tf

    import parallax
    from parallax.bench import models

    strategy = parallax.ParallaxStrategy(ps_addresses=addresses, run_id=run_id,
                                         log_plan=False, search_partitions=False,
                                         wire_dtype=dtype)
    with strategy.scope():
        model = models.BenchModel(spec)
        optimizer = keras.optimizers.SGD(learning_rate=spec.lr)
    step_fn = models.train_fn(model, optimizer, 1.0)
    batches = iter(models.dataset(spec, 0))

    @tf.function
    def train(batch):
        return strategy.run(step_fn, args=(batch,))

    def step() -> float:
        return float(train(next(batches)))

    def sync() -> None:
        for table in strategy.tables.values():
            table.wait_for_pushes()
    return strategy, step, sync


def _round(run, steps: int, client) -> dict:
    strategy, step, sync, run_id, losses = run
    before = _row_bytes(client, run_id)
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    sync()
    seconds = time.perf_counter() - start
    return {"steps_per_s": steps / seconds,
            "row_bytes_per_step": (_row_bytes(client, run_id) - before) / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per round and dtype")
    parser.add_argument("--vocab", type=int, default=100_000, help="rows of each lm table")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    from parallax.bench import workloads
    from parallax.client import PSClient
    from parallax.client.local_cluster import LocalCluster

    spec = dataclasses.replace(workloads.get("lm", "short"), table_rows=(args.vocab,) * 2,
                               batch_per_worker=args.batch)
    with LocalCluster(2) as cluster, PSClient(cluster.addresses) as client:
        tag = int(time.time())
        runs = {}
        for dtype in DTYPES:
            run_id = f"wire-{dtype}-{tag}"
            runs[dtype] = (*_setup(spec, dtype, cluster.addresses, run_id), run_id, [])
            runs[dtype][1]()  # the first step makes the plan and the tables: not timed
        samples = {dtype: [] for dtype in DTYPES}
        for _ in range(args.rounds):
            for dtype in DTYPES:
                samples[dtype].append(_round(runs[dtype], args.steps, client))
    _report(args, spec, runs, samples)


def _report(args, spec, runs, samples) -> None:
    base = np.array(runs["float32"][4])
    results = {}
    print(f"lm workload: 2 tables of {spec.table_rows[0]} x {spec.table_dim}, batch "
          f"{spec.batch_per_worker}, {args.rounds} rounds x {args.steps} steps per dtype, "
          f"1 worker, 2 servers")
    print(f"{'wire':9} {'row KB/step':>12} {'vs fp32':>8} {'steps/s':>8} {'vs fp32':>8} "
          f"{'max |dloss|':>12} {'final loss':>11} {'final dloss':>12}")
    for dtype in DTYPES:
        losses = np.array(runs[dtype][4])
        nbytes = statistics.median(s["row_bytes_per_step"] for s in samples[dtype])
        speed = statistics.median(s["steps_per_s"] for s in samples[dtype])
        tail = max(1, len(losses) // 10)
        final, final_base = losses[-tail:].mean(), base[-tail:].mean()
        results[dtype] = {"row_bytes_per_step": nbytes, "steps_per_s": speed,
                          "max_abs_loss_diff": float(np.abs(losses - base).max()),
                          "final_loss": float(final),
                          "final_loss_diff": float(final - final_base),
                          "speeds": [s["steps_per_s"] for s in samples[dtype]]}
        r, r32 = results[dtype], results.get("float32", results[dtype])
        print(f"{dtype:9} {nbytes / 1024:12.1f} {nbytes / r32['row_bytes_per_step']:8.3f} "
              f"{speed:8.2f} {speed / r32['steps_per_s']:8.3f} "
              f"{r['max_abs_loss_diff']:12.2e} {final:11.5f} {r['final_loss_diff']:12.2e}")
    out = Path("bench-results")
    out.mkdir(exist_ok=True)
    (out / "wire_dtype.json").write_text(json.dumps(
        {"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
