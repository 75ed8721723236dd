"""`parallax ps-demo`: a local cluster of parameter servers and a client round trip.

Starts S servers on loopback, creates a sharded table, runs a few synchronous steps that pull
Zipf-distributed rows and push the gradient of a least-squares loss (so the loss must fall),
saves a checkpoint, restores it into a table with a different shard count, and prints stats.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time

import numpy as np

from parallax.client import PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.protocol.specs import Adagrad, Initializer, TableSpec
from parallax.runtime import logs


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="parallax ps-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2,
                        help="parameter servers started on this machine (default 2)")
    parser.add_argument("--vocab", type=int, default=200_000,
                        help="rows of the demo table (default 200000)")
    parser.add_argument("--dim", type=int, default=32, help="columns of a row (default 32)")
    parser.add_argument("--batch", type=int, default=4096,
                        help="ids pulled and pushed per step (default 4096)")
    parser.add_argument("--steps", type=int, default=20, help="steps to run (default 20)")
    return logs.parse(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="parallax-demo-") as data_dir, \
            LocalCluster(args.servers, data_dir=data_dir, echo=sys.stderr) as cluster, \
            PSClient(cluster.addresses) as client:
        print(f"started {args.servers} parameter servers: {', '.join(cluster.addresses)}")
        spec = TableSpec(name="demo_embedding", vocabulary_size=args.vocab, dim=args.dim,
                         shard_count=args.servers,
                         initializer=Initializer(kind="uniform", minval=-1, maxval=1, seed=1),
                         optimizer=Adagrad(learning_rate=0.5))
        t0 = time.perf_counter()
        table = client.create_table(spec)
        print(f"created table {spec.name!r}: {args.vocab} x {args.dim} float32 in "
              f"{args.servers} shards ({time.perf_counter() - t0:.2f}s)")
        target = np.ones(args.dim, dtype=np.float32)
        for step in range(args.steps):
            ids = np.minimum(rng.zipf(1.2, size=args.batch) - 1, args.vocab - 1)
            rows = table.pull(ids, min_step=step)
            diff = rows - target
            loss = float(0.5 * np.mean(np.sum(diff * diff, axis=1)))
            table.push(ids, diff / len(ids), step=step)
            if step % 5 == 0 or step == args.steps - 1:
                print(f"step {step:3d}: pulled {len(ids)} ids ({len(np.unique(ids))} unique), "
                      f"loss {loss:.4f}")
        table.wait_step(args.steps)
        saved = client.save("demo-checkpoint")
        print(f"saved {sum(s.rows for s in saved)} rows from {len(saved)} shards")
        resharded = dataclasses.replace(spec, shard_count=args.servers + 1)
        client.delete_table(table)
        table = client.create_table(resharded)
        restored = client.restore("demo-checkpoint")
        probe = np.arange(0, args.vocab, max(1, args.vocab // 1000))
        print(f"restored into {resharded.shard_count} shards ({sum(s.rows for s in restored)} "
              f"rows); {len(probe)} probe rows readable: "
              f"{table.pull(probe).shape}")
        for address, stats in client.stats().items():
            for t in stats.tables:
                print(f"server {address}: {t.table}[{t.shard_index}/{t.shard_count}] "
                      f"{t.rows} rows, {t.bytes / 2**20:.1f} MiB, step {t.step}")
    print(f"servers stopped with exit codes {cluster.exit_codes}")
    return 0 if all(code == 0 for code in cluster.exit_codes) else 1
