"""A worker for `parallax run --replay-mb` tests, without TensorFlow: trains a 2-shard table
(one shard on each of the 2 servers) 3 steps, saves a checkpoint, trains one more step,
kills server 1 with SIGKILL (its pid from Stats), waits until a server answers at its
address again (the launcher starts one with --restore-newest), creates the table there
afresh and prints {"replay": 1, "old_pid", "new_pid", "steps" (CreateTable's answer per
shard), "restored" (shard 1's rows equal the checkpoint's), "addresses"} as one JSON line.
It replays nothing (parallax.client.replay does that): shard 1 is at the checkpoint's step.
"""
import json
import os
import signal
import time

import numpy as np

from parallax.client import PSClient
from parallax.client.connection import ClientOptions, client_options_from_env
from parallax.env import ADDRESSES_ENV, REPLAY_ENV
from parallax.protocol.specs import Adagrad, Initializer, TableSpec
from parallax.ps.v1 import ps_pb2

BACK_WITHIN_S = 60.0  # the replacement's start, on a loaded machine
SPEC = TableSpec(name="replayed", vocabulary_size=100, dim=4, shard_count=2,
                 optimizer=Adagrad(0.1), initializer=Initializer("uniform", seed=2))


def push(table, step: int) -> None:
    rng = np.random.default_rng(step)
    table.push(np.arange(100), rng.normal(size=(100, 4)), step=step)


def main() -> None:
    addresses = os.environ[ADDRESSES_ENV].split(",")
    options = client_options_from_env(ClientOptions(timeout=20, retries=1, backoff=0.05))
    assert options.replay_mb == int(os.environ[REPLAY_ENV]), options
    with PSClient(addresses, options) as client:
        table = client.create_table(SPEC)
        for step in range(3):
            push(table, step)
        client.save("ckpt", [SPEC.name])
        saved = table.pull_all()[1::2]  # shard 1's rows (partition mod)
        push(table, 3)
        old_pid = client.stats()[addresses[1]].pid
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + BACK_WITHIN_S
    while True:
        try:
            with PSClient(addresses, options) as client:
                new_pid = client.stats()[addresses[1]].pid
                if new_pid != old_pid:
                    break
        except Exception:  # noqa: BLE001 - not back yet
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)
    with PSClient(addresses, options) as client:
        table = client.table(SPEC)
        steps = [conn.stub().CreateTable(ps_pb2.CreateTableRequest(
            spec=SPEC.to_proto(), shard_index=i), timeout=30).step
            for i, conn in enumerate(table.shards)]
        restored = bool(np.array_equal(table.pull_all()[1::2], saved))
    print(json.dumps({"replay": 1, "old_pid": old_pid, "new_pid": new_pid, "steps": steps,
                      "restored": restored, "addresses": addresses}), flush=True)


if __name__ == "__main__":
    main()
