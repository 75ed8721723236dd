"""Rows on the wire as float32, bfloat16 and float16 (`ParallaxStrategy(wire_dtype=...)`), side
by side in one run: row bytes per worker per step (from the servers' stats), step throughput,
and the loss of the `lm` benchmark workload (parallax.bench) against float32's, step by step.

One strategy (its own run id, so its own tables) per series, each training the same model
from the same initial values on the same batches. Rounds alternate the series (float32,
bfloat16, float16, float32, ...), so a machine's drift hits each alike; throughput is the
median over rounds. `--control R` adds a float32 series whose learning rate is (1 + R) times
the others': how far a perturbation that has nothing to do with the wire moves the loss (once
training turns chaotic, any perturbation grows alike). Losses are compared per step and as
means over windows of `--window` steps; `--bound` is checked on the windowed relative
difference.

Alone it starts 2 local `parallax server` processes and is the one worker; under `parallax
run -np N` it uses the job's servers and every worker trains (rank 0 reports, with its own
losses). It prints a table and writes bench-results/wire_dtype.json (every step's loss) and,
with --plot, bench-results/wire_dtype_loss.png and wire_dtype_loss_diff.png.

    PYTHONPATH=.:servers .venv/bin/python examples/benchmarks/wire_dtype.py \\
        [--rounds 5] [--steps 40] [--vocab 100000] [--batch 256] [--lr 0.05] \\
        [--control 1e-3] [--window 100] [--bound 1e-3] [--plot]
    parallax run -np 2 --servers 2 examples/benchmarks/wire_dtype.py [flags]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
CONTROL = "float32-lr"  # the control series' name: float32 on the wire, another learning rate
ROW_METHODS = ("Pull", "Push", "PullMany", "PushMany")  # the packed ones count as *Many
OUT = Path("bench-results")
COLORS = {"float32": "tab:blue", "bfloat16": "tab:orange", "float16": "tab:green",
          CONTROL: "tab:red"}  # the same series in the same colour in both plots


@dataclasses.dataclass
class Series:
    """One strategy being trained: its wire dtype, step function and every step's loss."""

    name: str
    strategy: object
    step: object
    sync: object
    run_id: str
    losses: list = dataclasses.field(default_factory=list)
    samples: list = dataclasses.field(default_factory=list)


def _row_bytes(client, run_id: str) -> int:
    """Row bytes the servers moved for this run's tables so far (pulls and pushes)."""
    total = 0
    for reply in client.stats().values():
        for table in reply.tables:
            if table.table.startswith(run_id + "."):
                total += sum(m.bytes for m in table.methods if m.method in ROW_METHODS)
    return total


def _setup(spec, name: str, dtype: str, addresses, run_id: str) -> Series:
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
    step_fn = models.train_fn(model, optimizer, 1.0 / strategy.num_replicas_in_sync)
    batches = iter(models.dataset(spec, strategy.worker.rank))

    @tf.function
    def train(batch):
        return strategy.run(step_fn, args=(batch,))

    def step() -> float:
        return float(train(next(batches)))

    def sync() -> None:
        for table in strategy.tables.values():
            table.wait_for_pushes()
    return Series(name, strategy, step, sync, run_id)


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes `pids` have used so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return total / os.sysconf("SC_CLK_TCK")


def _round(series: Series, steps: int, client, servers: list[int]) -> None:
    """`steps` steps of one series, timed up to the last push landing, with this worker's
    CPU and (local servers only) the servers'; rank 0 (which holds `client`) also counts the
    row bytes the servers moved meanwhile."""
    before = _row_bytes(client, series.run_id) if client else 0
    cpu, server_cpu = time.process_time(), _cpu_seconds(servers)
    start = time.perf_counter()
    for _ in range(steps):
        series.losses.append(series.step())
    series.sync()
    seconds = time.perf_counter() - start
    moved = (_row_bytes(client, series.run_id) - before) if client else 0
    series.samples.append({
        "steps_per_s": steps / seconds,
        "worker_cpu_ms_per_step": (time.process_time() - cpu) / steps * 1e3,
        "server_cpu_ms_per_step": ((_cpu_seconds(servers) - server_cpu) / steps * 1e3
                                   if servers else None),
        "row_bytes_per_step": moved / steps / series.strategy.worker.size})


@contextlib.contextmanager
def _servers():
    """(server addresses, a tag every worker shares, the servers' pids if local):
    `parallax run`'s servers and job id, or 2 local servers started here."""
    from parallax import env
    from parallax.client.local_cluster import LocalCluster

    given = os.environ.get(env.ADDRESSES_ENV)
    if given:
        yield given.split(","), os.environ.get(env.RUN_ID_ENV) or "wire", []
        return
    with LocalCluster(2) as cluster:
        yield (cluster.addresses, f"wire{int(time.time())}",
               [server.proc.pid for server in cluster.servers])


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per round and series")
    parser.add_argument("--vocab", type=int, default=100_000, help="rows of each lm table")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=None,
                        help="SGD learning rate (default: the workload's, 0.05, at which "
                             "the loss moves little in a few hundred steps)")
    parser.add_argument("--control", type=float, default=0.0,
                        help="add a float32 series at (1 + CONTROL) x the learning rate")
    parser.add_argument("--window", type=int, default=100, help="steps per loss window")
    parser.add_argument("--bound", type=float, default=1e-3,
                        help="the windowed relative loss difference against float32 to check")
    parser.add_argument("--plot", action="store_true", help="draw the loss curves too")
    args = parser.parse_args()
    if args.window < 1 or args.window > args.rounds * args.steps:
        parser.error(f"--window {args.window} must be between 1 and the steps per series "
                     f"({args.rounds * args.steps}); pass a smaller one")
    return args


def main() -> None:
    args = _args()
    from parallax.bench import workloads
    from parallax.client import PSClient

    spec = workloads.get("lm", "short")
    spec = dataclasses.replace(spec, table_rows=(args.vocab,) * 2, batch_per_worker=args.batch,
                               lr=spec.lr if args.lr is None else args.lr)
    plan = [(d, d, spec) for d in DTYPES]
    if args.control:
        plan.append((CONTROL, "float32",
                     dataclasses.replace(spec, lr=spec.lr * (1 + args.control))))
    with _servers() as (addresses, tag, pids), PSClient(addresses) as client:
        runs = {}
        for name, dtype, series_spec in plan:
            runs[name] = _setup(series_spec, name, dtype, addresses, f"{tag}-{name}")
            runs[name].step()  # the first step makes the plan and the tables: not timed
        rank = runs["float32"].strategy.worker.rank
        for _ in range(args.rounds):
            for series in runs.values():
                _round(series, args.steps, client if rank == 0 else None, pids)
    if rank == 0:
        results = _report(args, spec, runs)
        if args.plot:
            _plot(results, args.bound, OUT)


def _loss_diff(losses: list[float], base: list[float], window: int) -> dict:
    """The loss against float32's, relative to float32's: the largest per step and per
    window (mean over `window` steps), and the last window's (signed), absolute too."""
    loss, ref = np.array(losses), np.array(base)
    diff = loss - ref
    whole = len(loss) // window * window
    means = loss[:whole].reshape(-1, window).mean(axis=1)
    ref_means = ref[:whole].reshape(-1, window).mean(axis=1)
    return {"max_abs_loss_diff": float(np.abs(diff).max()),
            "max_rel_loss_diff": float(np.abs(diff / ref).max()),
            "max_abs_window_diff": float(np.abs(means - ref_means).max()),
            "max_rel_window_diff": float(np.abs((means - ref_means) / ref_means).max()),
            "final_loss": float(means[-1]),
            "final_loss_diff": float(means[-1] - ref_means[-1]),
            "final_rel_loss_diff": float((means[-1] - ref_means[-1]) / ref_means[-1]),
            "losses": [float(x) for x in loss]}


def _cpu(samples: list[dict]) -> dict:
    """Median CPU per step over rounds: this worker's and (local servers) the servers'."""
    servers = [s["server_cpu_ms_per_step"] for s in samples]
    return {"worker_cpu_ms_per_step": statistics.median(s["worker_cpu_ms_per_step"]
                                                        for s in samples),
            "server_cpu_ms_per_step": None if None in servers else statistics.median(servers)}


def _cpu_text(r: dict) -> str:
    """'worker+servers' CPU ms per step, or the worker's alone."""
    worker, servers = r["worker_cpu_ms_per_step"], r["server_cpu_ms_per_step"]
    return f"{worker:.1f}" if servers is None else f"{worker:.1f}+{servers:.1f}"


def _report(args, spec, runs: dict[str, Series]) -> dict:
    workers = runs["float32"].strategy.worker.size
    print(f"lm workload: 2 tables of {spec.table_rows[0]} x {spec.table_dim}, batch "
          f"{spec.batch_per_worker}, SGD lr {spec.lr:g}, {args.rounds} rounds x {args.steps} "
          f"steps per series, {workers} worker(s), 2 servers; windows of {args.window} steps")
    print(f"{'series':10} {'row KB/step':>11} {'vs fp32':>7} {'steps/s':>8} {'vs fp32':>7} "
          f"{'CPU ms/step':>11} {'max rel/step':>12} {'max rel/window':>14} "
          f"{'final loss':>10} {'final rel':>10}")
    results = {}
    for name, series in runs.items():
        nbytes = statistics.median(s["row_bytes_per_step"] for s in series.samples)
        speed = statistics.median(s["steps_per_s"] for s in series.samples)
        r = results[name] = {"row_bytes_per_step": nbytes, "steps_per_s": speed,
                             **_cpu(series.samples), "rounds": series.samples,
                             **_loss_diff(series.losses, runs["float32"].losses, args.window)}
        r32 = results["float32"]
        print(f"{name:10} {nbytes / 1024:11.1f} {nbytes / r32['row_bytes_per_step']:7.3f} "
              f"{speed:8.2f} {speed / r32['steps_per_s']:7.3f} {_cpu_text(r):>11} "
              f"{r['max_rel_loss_diff']:12.2e} "
              f"{r['max_rel_window_diff']:14.2e} {r['final_loss']:10.5f} "
              f"{r['final_rel_loss_diff']:10.2e}")
    worst = max(results[d]["max_rel_window_diff"] for d in DTYPES)
    print(f"bound: |window mean loss - float32's| <= {args.bound:g} x float32's in every "
          f"window: {'holds' if worst <= args.bound else 'MISSED'} (largest {worst:.2e})")
    OUT.mkdir(exist_ok=True)
    (OUT / "wire_dtype.json").write_text(json.dumps(
        {"args": vars(args), "workers": workers, "results": results}, indent=2))
    return results


def _plot(results: dict, bound: float, out: Path) -> None:
    """wire_dtype_loss.png (every series' loss by step) and wire_dtype_loss_diff.png (the
    relative difference against float32's per step, with the bound)."""
    from parallax.bench.figures import figure

    fig, ax = figure()
    for name, r in results.items():
        ax.plot(r["losses"], label=name, linewidth=0.8, color=COLORS[name])
    ax.set(xlabel="step", ylabel="loss (lm, worker 0)", title="lm loss by wire dtype")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out / "wire_dtype_loss.png")
    fig, ax = figure()
    base = np.array(results["float32"]["losses"])
    for name, r in list(results.items())[1:]:
        rel = np.abs(np.array(r["losses"]) - base) / base
        ax.plot(np.maximum(rel, 1e-9), label=name, linewidth=0.8, color=COLORS[name])
    ax.axhline(bound, color="red", linestyle="--", label=f"bound {bound:g} (on window means)")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="|loss - float32's| / float32's, per step (floor 1e-9)",
           title="lm loss against float32")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(out / "wire_dtype_loss_diff.png")


if __name__ == "__main__":
    main()
