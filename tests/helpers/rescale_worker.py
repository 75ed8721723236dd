"""A worker for tests/parallel/test_elastic.py that stops for a new worker count where a
custom loop does, `ParallaxStrategy.rescale_point`, with no model (nothing to train): it
prints {"rescale_worker": "ready", "attempt", "rank", "size"}, then calls the strategy's
rescale point every --every seconds, --points times, and prints "end". --slow-note S makes
the chief take S seconds to note its stop for the launcher (a loaded machine's scheduling
may); attempts after the first (PARALLAX_RESTART_COUNT >= 1) print "again" with their size,
and end at once. --global-batch N first distributes a dataset of global batches of N
(`experimental_distribute_dataset`, which splits each among the workers; with --from-function,
`distribute_datasets_from_function`, whose function batches by its context's
`get_per_replica_batch_size(N)`).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
parser = argparse.ArgumentParser()
parser.add_argument("--points", type=int, default=60)
parser.add_argument("--every", type=float, default=0.5)
parser.add_argument("--slow-note", type=float, default=0.0)
parser.add_argument("--global-batch", type=int, default=0)
parser.add_argument("--from-function", action="store_true")
args = parser.parse_args()
attempt = int(os.environ.get("PARALLAX_RESTART_COUNT", "0"))


def say(event: str, rank: int, size: int) -> None:
    print(json.dumps({"rescale_worker": event, "attempt": attempt, "rank": rank,
                      "size": size}), flush=True)


if attempt:
    say("again", int(os.environ.get("HOROVOD_RANK", "0")),
        int(os.environ.get("HOROVOD_SIZE", "1")))
    raise SystemExit(0)

import parallax  # noqa: E402
from parallax.tf.state import rescale  # noqa: E402

strategy = parallax.ParallaxStrategy(log_plan=False)
if args.slow_note:
    note = rescale.note_rescale_stop

    def slow_note(path, epoch):
        time.sleep(args.slow_note)
        note(path, epoch)
    rescale.note_rescale_stop = slow_note
say("ready", strategy.worker.rank, strategy.worker.size)
if args.global_batch:
    import tensorflow as tf
    data = tf.data.Dataset.range(4 * args.global_batch)
    if args.from_function:
        strategy.distribute_datasets_from_function(
            lambda context: data.batch(context.get_per_replica_batch_size(args.global_batch)))
    else:
        strategy.experimental_distribute_dataset(data.batch(args.global_batch))
for point in range(1, args.points + 1):
    time.sleep(args.every)
    strategy.rescale_point(point)
say("end", strategy.worker.rank, strategy.worker.size)
