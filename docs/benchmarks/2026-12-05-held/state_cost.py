"""What the dense part of a held commit costs on the servers: `PSClient.hold_state` (the
chief's held backup bytes split over the servers, beside a held mark) and `held_state` (read
back whole, as a restarted chief does), for states of a few sizes.

Two real servers on loopback, one table held; 5 saves per size, the median of each:

    python docs/benchmarks/2026-12-05-held/state_cost.py [--sizes-mib 0.01,1,16,64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.protocol.specs import Adagrad, TableSpec

SAVES = 5


def measure(client: PSClient, size: int) -> dict:
    state = np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes()
    put, get = [], []
    for _ in range(SAVES):
        name = client.save("cost", ["t"], keep=2, held=True)[0].checkpoint
        start = time.perf_counter()
        client.hold_state("cost", ["t"], name, state, keep=2)
        put.append(time.perf_counter() - start)
        start = time.perf_counter()
        if client.held_state("cost") != (name, state):
            raise SystemExit(f"held_state did not read back the state of {name}")
        get.append(time.perf_counter() - start)
    return {"mib": size / 2**20, "hold_state_ms": round(statistics.median(put) * 1e3, 1),
            "held_state_ms": round(statistics.median(get) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="0.01,1,16,64")
    args = parser.parse_args()
    with LocalCluster(2) as cluster, PSClient(cluster.addresses,
                                              ClientOptions(timeout=60)) as client:
        client.create_table(TableSpec(name="t", vocabulary_size=1000, dim=4, shard_count=2,
                                      optimizer=Adagrad(0.1), num_workers=1))
        for mib in args.sizes_mib.split(","):
            print(json.dumps(measure(client, int(float(mib) * 2**20))), flush=True)


if __name__ == "__main__":
    main()
