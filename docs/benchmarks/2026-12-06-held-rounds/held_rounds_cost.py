"""What a held save and its state cost the chief (`PSClient.save(held=True)`, then
`PSClient.hold_state`, as a held backup makes them): 2 server processes on loopback, a
100,000 x 16 Adagrad table in 2 shards, one push of 512 ids and its step before each save,
a state of --state-kib KiB; prints one JSON line: the median ms of each (the first 10 saves
left out). It measures whichever parallax PYTHONPATH names: run it from two trees in turn.

    PYTHONPATH=$TREE:$TREE/servers python held_rounds_cost.py [--saves 300] [--label main]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from parallax.client import ClientOptions, PSClient
from parallax.client.local_cluster import LocalCluster
from parallax.protocol.specs import Adagrad, TableSpec

ROWS, DIM, IDS = 100_000, 16, 512
WARM_SAVES = 10  # left out of the medians (connections, first marks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=300)
    parser.add_argument("--state-kib", type=int, default=20, help="the state's size, KiB")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    state = np.random.default_rng(0).integers(0, 256, args.state_kib << 10, np.uint8)
    with LocalCluster(2) as cluster, \
            PSClient(cluster.addresses, ClientOptions(timeout=30)) as client:
        table = client.create_table(TableSpec(name="t", vocabulary_size=ROWS, dim=DIM,
                                              shard_count=2, optimizer=Adagrad(0.1),
                                              num_workers=1))
        save_ms, hold_ms = timed(client, table, state.tobytes(), args.saves)
    save, hold = np.median(save_ms[WARM_SAVES:]), np.median(hold_ms[WARM_SAVES:])
    print(json.dumps({"label": args.label, "save_ms": round(save, 2),
                      "hold_state_ms": round(hold, 2), "total_ms": round(save + hold, 2)}))


def timed(client: PSClient, table, state: bytes, saves: int) -> tuple[list, list]:
    """ms of each held save and of its hold_state, a step before each."""
    rng = np.random.default_rng(1)
    save_ms, hold_ms = [], []
    for step in range(saves):
        ids = np.unique(rng.integers(0, ROWS, IDS))
        table.push(ids, np.ones((len(ids), DIM), np.float32), step=step, worker=0)
        table.wait_step(step + 1)
        start = time.perf_counter()
        name = client.save("job", [table.name], keep=2, held=True)[0].checkpoint
        saved = time.perf_counter()
        client.hold_state("job", [table.name], name, state, keep=2)
        save_ms.append(1e3 * (saved - start))
        hold_ms.append(1e3 * (time.perf_counter() - saved))
    return save_ms, hold_ms


if __name__ == "__main__":
    main()
