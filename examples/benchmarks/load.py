"""Load test of the parameter servers: many concurrent clients, realistic mixed traffic.

What it does
    `--clients` workers (threads, spread over `--processes` client processes so that the
    clients are not bound by one GIL) train against `--servers` real server processes for
    `--seconds`. Each worker, every iteration:

    * pulls and pushes an async fixed-vocabulary table (Pull, Push) and an async keyed
      table (`hashed_keys=True`; its results keep the names `*_hashed`), with hot
      (Pareto-distributed) ids and duplicates;
    * pulls both in one PullMany and pushes both in one PushMany (parallax.client.many);
    * pulls its group's sync table at the open step and pushes that step: `--group` workers
      share one sync table (num_workers = the group), so they advance in lockstep.

    Gradients are multiples of 1/4 and the tables SGD with learning rate 1 from zeros, so
    float32 sums are exact: afterwards every row must equal minus the sum of what was pushed
    to it, and every sync table must be at the step its workers reached. Any error of any
    request is counted. Latency is per call of the client API, in milliseconds (a sync pull
    includes the wait for the slowest worker of its group).

How to run
    .venv/bin/python examples/benchmarks/load.py                  # 64 clients, 10 s
    .venv/bin/python examples/benchmarks/load.py --clients 128 --processes 8 --seconds 30

    Prints p50/p99/max latency and calls/s per method, then the correctness checks; exits 1
    if any request failed or any row is off.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.client.many import pull_many, push_many
from parallax.protocol.specs import SGD, TableSpec

METHODS = ("pull", "push", "pull_hashed", "push_hashed", "pull_many", "push_many",
           "sync_pull", "sync_push")


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 64
    processes: int = 4
    seconds: float = 10.0
    group: int = 8          # workers that push one sync table (its num_workers)
    vocab: int = 10_000     # rows of the fixed-vocabulary tables
    keys: int = 5_000       # distinct keys the keyed table sees
    dim: int = 8
    ids: int = 64           # ids per request
    timeout: float = 60.0   # seconds per RPC

    @property
    def groups(self) -> int:
        return self.clients // self.group

    def check(self) -> None:
        per_process = self.clients // self.processes
        if self.clients % self.processes or per_process % self.group:
            raise SystemExit(f"--clients {self.clients} must split into --processes "
                             f"{self.processes} of whole sync groups of {self.group}")


def specs(config: LoadConfig) -> dict[str, TableSpec]:
    """Every table of the load: two async tables all clients share, one sync table a group."""
    sgd = SGD(learning_rate=1.0)
    tables = [
        TableSpec(name="load_async", vocabulary_size=config.vocab, dim=config.dim,
                  shard_count=4, num_workers=config.clients, sync_mode="async", optimizer=sgd),
        TableSpec(name="load_hashed", hashed_keys=True, vocabulary_size=0, dim=config.dim,
                  shard_count=2, num_workers=config.clients, sync_mode="async", optimizer=sgd),
    ]
    tables += [TableSpec(name=f"load_sync_{g}", vocabulary_size=config.vocab, dim=config.dim,
                         shard_count=2, num_workers=config.group, optimizer=sgd)
               for g in range(config.groups)]
    return {spec.name: spec for spec in tables}


def key_space(config: LoadConfig) -> np.ndarray:
    """The keyed table's keys: arbitrary int64 values, negative ones too."""
    return np.random.default_rng(0).choice(2**62, size=config.keys, replace=False) - 2**61


# ---- one client process --------------------------------------------------------------------
@dataclass
class Totals:
    """What a process's workers pushed and saw: summed gradients per table, latencies."""

    deltas: dict[str, np.ndarray]
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    sync_steps: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, table: str, index: np.ndarray, grads: np.ndarray) -> None:
        with self.lock:
            np.add.at(self.deltas[table], index, grads)

    def portable(self) -> dict:
        return {"deltas": self.deltas, "latencies": self.latencies, "errors": self.errors,
                "sync_steps": self.sync_steps}


class GroupStop:
    """When a sync group stops: the first of its workers to see the time up picks a step
    every worker can still push (none is past it in lockstep); all stop there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step: int | None = None

    def done(self, step: int, time_up: bool) -> bool:
        with self._lock:
            if self.step is None and time_up:
                self.step = step + 1
            return self.step is not None and step >= self.step


class Worker:
    def __init__(self, rank: int, tables: dict, config: LoadConfig, totals: Totals,
                 keys: np.ndarray) -> None:
        self.rank, self.config, self.totals, self.keys = rank, config, totals, keys
        self.rng = np.random.default_rng(rank)
        self.async_table, self.keyed = tables["load_async"], tables["load_hashed"]
        self.sync = tables[f"load_sync_{rank // config.group}"]
        self.pushes = 0  # this worker's async push counter (its steps)
        self.latencies: dict[str, list[float]] = {m: [] for m in METHODS}

    def timed(self, method: str, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.latencies[method].append(time.perf_counter() - start)
        return result

    def draw(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Hot, duplicated indices into `size` rows, and gradients in multiples of 1/4."""
        index = (self.rng.pareto(1.0, self.config.ids) * 20).astype(np.int64) % size
        grads = self.rng.integers(-4, 5, size=(len(index), self.config.dim)) / 4
        return index, grads.astype(np.float32)

    def step(self) -> None:
        """Pull and push each async table, then both in one PullMany and one PushMany."""
        ids, grads = self.draw(self.config.vocab)
        self.timed("pull", self.async_table.pull, ids)
        self._push("push", self.async_table.push, "load_async", ids, ids, grads)
        index, hgrads = self.draw(self.config.keys)
        self.timed("pull_hashed", self.keyed.pull, self.keys[index])
        self._push("push_hashed", self.keyed.push, "load_hashed", index, self.keys[index],
                   hgrads)
        tables = [self.async_table, self.keyed]
        self.timed("pull_many", pull_many, tables, [np.unique(ids), np.unique(self.keys[index])],
                   [0, 0])
        self.timed("push_many", push_many, tables, [ids, self.keys[index]], [grads, hgrads],
                   [self.pushes, self.pushes], self.rank, [0.0, 0.0])
        self.pushes += 1
        self.totals.add("load_async", ids, grads)
        self.totals.add("load_hashed", index, hgrads)

    def _push(self, method: str, push, table: str, index, ids, grads) -> None:
        self.timed(method, push, ids, grads, step=self.pushes, worker=self.rank)
        self.pushes += 1
        self.totals.add(table, index, grads)

    def sync_step(self, step: int) -> None:
        ids, grads = self.draw(self.config.vocab)
        self.timed("sync_pull", self.sync.pull, ids, min_step=step)
        self.timed("sync_push", self.sync.push, ids, grads, step=step,
                   worker=self.rank % self.config.group)
        self.totals.add(self.sync.name, ids, grads)

    def run(self, deadline: float, stop: GroupStop) -> None:
        step = 0
        try:
            while not stop.done(step, time.monotonic() >= deadline):
                self.step()
                self.sync_step(step)
                step += 1
        except Exception:  # noqa: BLE001 - every failure is counted and shown
            self.totals.errors.append(f"worker {self.rank}: {traceback.format_exc(limit=3)}")
            stop.done(step, True)
        with self.totals.lock:
            for method, values in self.latencies.items():
                self.totals.latencies.setdefault(method, []).extend(values)
            self.totals.sync_steps[self.sync.name] = step


def client_process(addresses: list[str], config: LoadConfig, process: int, start_at: float,
                   queue) -> None:
    """Run this process's workers until the deadline; put their Totals on `queue`."""
    all_specs = specs(config)
    keys = key_space(config)
    per_process = config.clients // config.processes
    ranks = range(process * per_process, (process + 1) * per_process)
    totals = Totals({name: np.zeros((config.keys if spec.hashed_keys else config.vocab,
                                     config.dim)) for name, spec in all_specs.items()})
    with PSClient(addresses, ClientOptions(timeout=config.timeout)) as client:
        tables = {name: client.table(spec) for name, spec in all_specs.items()}
        stops = {g: GroupStop() for g in {r // config.group for r in ranks}}
        workers = [Worker(rank, tables, config, totals, keys) for rank in ranks]
        time.sleep(max(0.0, start_at - time.time()))
        deadline = time.monotonic() + config.seconds
        threads = [threading.Thread(target=w.run, args=(deadline, stops[w.rank // config.group]))
                   for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    queue.put(totals.portable())


# ---- the whole load ---------------------------------------------------------------------------
@dataclass
class LoadResult:
    latencies: dict[str, list[float]]
    errors: list[str]
    problems: list[str]
    seconds: float
    exit_codes: list[int | None]


def merge(parts: list[dict]) -> dict:
    merged = {"deltas": {}, "latencies": {}, "errors": [], "sync_steps": {}}
    for part in parts:
        for name, delta in part["deltas"].items():
            merged["deltas"][name] = merged["deltas"].get(name, 0) + delta
        for method, values in part["latencies"].items():
            merged["latencies"].setdefault(method, []).extend(values)
        merged["errors"] += part["errors"]
        for name, step in part["sync_steps"].items():
            merged["sync_steps"].setdefault(name, set()).add(step)
    return merged


def verify(client: PSClient, config: LoadConfig, merged: dict) -> list[str]:
    """Every row is minus what was pushed to it; every sync table at its workers' step."""
    problems = []
    keys = key_space(config)
    for name, spec in specs(config).items():
        table = client.table(spec)
        ids = keys if spec.hashed_keys else np.arange(config.vocab)
        rows = table.pull(ids)
        expected = -merged["deltas"][name].astype(np.float32)
        wrong = np.flatnonzero(np.any(rows != expected, axis=1))
        if len(wrong):
            problems.append(f"{name}: {len(wrong)} rows differ from minus the pushed sums, "
                            f"e.g. row {wrong[0]}: {rows[wrong[0]]} != {expected[wrong[0]]}")
        steps = merged["sync_steps"].get(name)
        if spec.sync_mode == "sync" and steps is not None:
            reached = table.wait_step(0)
            if steps != {reached}:
                problems.append(f"{name}: at step {reached}, its workers stopped at {steps}")
    return problems


def run_load(addresses: list[str], config: LoadConfig) -> LoadResult:
    """Create the tables, run the client processes, check the rows."""
    config.check()
    with PSClient(addresses, ClientOptions(timeout=config.timeout)) as client:
        for spec in specs(config).values():
            client.create_table(spec)
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        start_at = time.time() + 3.0  # every process connected and ready
        processes = [context.Process(target=client_process,
                                     args=(addresses, config, p, start_at, queue))
                     for p in range(config.processes)]
        for process in processes:
            process.start()
        parts = [queue.get(timeout=config.seconds + 10 * config.timeout) for _ in processes]
        for process in processes:
            process.join()
        merged = merge(parts)
        problems = verify(client, config, merged)
    codes = [p.exitcode for p in processes]
    if codes != [0] * len(codes):
        problems.append(f"client processes exited with {codes}")
    return LoadResult(merged["latencies"], merged["errors"], problems, config.seconds, codes)


def report(result: LoadResult) -> str:
    """p50/p99/max latency in ms and calls/s per method, then errors and problems."""
    lines = [f"{'method':<12} {'calls':>7} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
             f"{'max ms':>8}"]
    for method in METHODS:
        values = np.array(result.latencies.get(method, [])) * 1e3
        if not len(values):
            continue
        p50, p99 = np.percentile(values, [50, 99])
        lines.append(f"{method:<12} {len(values):>7} {len(values) / result.seconds:>8.0f} "
                     f"{p50:>8.2f} {p99:>8.2f} {values.max():>8.2f}")
    lines.append(f"errors: {len(result.errors)}; correctness problems: {len(result.problems)}")
    lines += result.errors[:5] + result.problems[:5]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--group", type=int, default=8, help="workers per sync table")
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args(argv)
    config = LoadConfig(clients=args.clients, processes=args.processes, seconds=args.seconds,
                        group=args.group)
    with LocalCluster(args.servers) as cluster:
        result = run_load(cluster.addresses, config)
    print(f"{config.clients} clients in {config.processes} processes, {args.servers} servers, "
          f"{config.seconds:.0f} s")
    print(report(result))
    if cluster.exit_codes != [0] * args.servers:
        print(f"servers exited with {cluster.exit_codes}")
        return 1
    return 1 if result.errors or result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
