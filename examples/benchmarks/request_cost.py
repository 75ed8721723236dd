"""CPU per request and per row of a training step's traffic: per-table, fused over gRPC and
fused over the data plane, beside the raw Python gRPC round trip, measured in one run in
alternating rounds (medians).

A CTR-like step: T tables (default 26) of dim 16 spread over 2 `parallax server` processes,
about 190 unique ids per table per step (256 Zipf-free draws from 400k rows), one sync
worker. Each mode runs STEPS steps of pull then push per round:
- `per-table`: `ShardedTable.pull_unique` and `.push` for every table (2 x T gRPC requests);
- `fused-grpc`: `pull_many` and `push_many` over gRPC (one PullMany and one PushMany per
  server; `ClientOptions(data_plane=False)`);
- `fused`: the same requests on the servers' data plane (`parallax.protocol.dataplane`),
  the default;
- `echo`: plain gRPC moving the same bytes in the same number of requests as `fused`
  (`grpc_echo.py`: no protobuf, no numpy: the floor for any Python gRPC data plane).
Server CPU comes from /proc (utime + stime of the server processes), the client's from
`time.process_time()`. It prints a table and writes bench-results/request_cost.json.

    .venv/bin/python examples/benchmarks/request_cost.py [--steps 300] [--tables 26] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_echo import EchoClient  # noqa: E402

from parallax.client import ClientOptions, PSClient  # noqa: E402
from parallax.client.many import pull_many, push_many  # noqa: E402
from parallax.client.local_cluster import LocalCluster  # noqa: E402
from parallax.protocol.specs import SGD, Initializer, TableSpec  # noqa: E402

DIM, ROWS, DRAWS = 16, 400_000, 256


def _cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _measure(step, steps: int, server_pids: list[int], start: int) -> dict:
    wall, client, server = time.perf_counter(), time.process_time(), _cpu_seconds(server_pids)
    for k in range(start, start + steps):
        step(k)
    return {"wall_s": (time.perf_counter() - wall) / steps,
            "client_cpu_s": (time.process_time() - client) / steps,
            "server_cpu_s": (_cpu_seconds(server_pids) - server) / steps}


def _median(rounds: list[dict]) -> dict:
    return {key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}


def _modes(cluster, tables: int, ids, grads) -> dict:
    """mode -> (step function, requests per step, closer)."""
    modes = {}
    for mode, options in (("per-table", ClientOptions(timeout=30, data_plane=False)),
                          ("fused-grpc", ClientOptions(timeout=30, data_plane=False)),
                          ("fused", ClientOptions(timeout=30))):
        client = PSClient(cluster.addresses, options)
        made = [client.create_table(TableSpec(
            name=f"{mode}-{t}", vocabulary_size=ROWS, dim=DIM, shard_count=1,
            initializer=Initializer("uniform", seed=t), optimizer=SGD(0.1)),
            placement=[t % 2]) for t in range(tables)]

        def per_table(k, made=made):
            for table, i in zip(made, ids):
                table.pull_unique(i, min_step=k)
            for table, i, g in zip(made, ids, grads):
                table.push(i, g, step=k)

        def fused(k, made=made):
            pull_many(made, ids, [k] * tables)
            push_many(made, ids, grads, [k] * tables, 0, [0.0] * tables)

        modes[mode] = (per_table if mode == "per-table" else fused,
                       2 * tables if mode == "per-table" else 4, client)
    return modes


def run(steps: int, tables: int, rounds: int = 3) -> dict:
    rng = np.random.default_rng(0)
    ids = [np.unique(rng.integers(0, ROWS, DRAWS)) for _ in range(tables)]
    grads = [np.full((len(i), DIM), 1e-3, np.float32) for i in ids]
    rows = sum(len(i) for i in ids)
    measured: dict[str, list[dict]] = {}
    echo = EchoClient(channels=2)
    pull_size = str(rows * DIM * 4 // 2).encode()
    push_payload = bytes(rows * (DIM * 4 + 8) // 2)

    def raw(k):
        for _ in range(2):  # one server's half, twice: pull then push sizes
            echo.get[0](pull_size)
            echo.put[0](push_payload)
    try:
        with LocalCluster(2) as cluster:
            pids = [s.proc.pid for s in cluster.servers]
            modes = _modes(cluster, tables, ids, grads)
            step = {mode: 0 for mode in modes}
            for mode, (fn, _, _) in modes.items():  # warm-up
                for _ in range(10):
                    fn(step[mode])
                    step[mode] += 1
            for _ in range(rounds):  # alternating rounds: each mode sees the same noise
                for mode, (fn, _, _) in modes.items():
                    measured.setdefault(mode, []).append(_measure(fn, steps, pids, step[mode]))
                    step[mode] += steps
                measured.setdefault("echo", []).append(_measure(raw, steps, [echo.proc.pid], 0))
            for _, _, client in modes.values():
                client.close()
    finally:
        echo.close()
    results = {mode: _median(r) for mode, r in measured.items()}
    for mode, figures in results.items():
        figures["requests_per_step"] = modes[mode][1] if mode in modes else 4
        figures["server_cpu_us_per_request"] = \
            figures["server_cpu_s"] / figures["requests_per_step"] * 1e6
        figures["server_cpu_us_per_row"] = figures["server_cpu_s"] / (2 * rows) * 1e6
        figures["client_cpu_us_per_request"] = \
            figures["client_cpu_s"] / figures["requests_per_step"] * 1e6
    return {"tables": tables, "rows_per_step": rows, "dim": DIM, "steps": steps,
            "rounds": rounds, "results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-results/request_cost.json"))
    args = parser.parse_args()
    report = run(args.steps, args.tables, args.rounds)
    print(f"{args.tables} tables, {report['rows_per_step']} unique rows per step (dim {DIM}), "
          f"2 servers, 1 sync worker, {args.steps} steps x {args.rounds} alternating rounds "
          f"(medians)")
    print(f"{'mode':11s} {'ms/step':>8s} {'requests':>9s} {'server CPU':>11s} "
          f"{'us/request':>11s} {'us/row':>7s} {'client CPU':>11s} {'us/request':>11s}")
    for mode, f in report["results"].items():
        print(f"{mode:11s} {f['wall_s'] * 1e3:8.2f} {f['requests_per_step']:9d} "
              f"{f['server_cpu_s'] * 1e3:9.2f}ms {f['server_cpu_us_per_request']:11.0f} "
              f"{f['server_cpu_us_per_row']:7.2f} {f['client_cpu_s'] * 1e3:9.2f}ms "
              f"{f['client_cpu_us_per_request']:11.0f}")
    write(args.out, report)
    return 0


def write(out: Path, report: dict) -> None:
    """The report as JSON at `out` (its folder made), and a line saying where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
