"""A worker for `parallax run` tests: reports what the launcher gave it, as one JSON line.

Initialises horovod.tensorflow when HOROVOD_SIZE is set (under horovodrun), or reads its rank
and size from PARALLAX_WORKERS and PARALLAX_WORKER_RANK (the TensorFlow supervisor); with
--collective it also sums rank + 1 over the workers through their collectives ("sum"); waits until
every server in PARALLAX_PS_ADDRESSES is serving, prints {"probe": 1, "rank", "size",
"addresses", "run_id", "pid", "netns", "mode", "sync", "restart", "cuda" (CUDA_VISIBLE_DEVICES),
"log_level" (PARALLAX_LOG_LEVEL), "warm" (TensorFlow imported before its first line: forked
from a warm process)}, optionally sleeps, and
exits with --exit CODE (only on --exit-rank R when given, at once; the other ranks sleep
and exit 0). With
--until-restart A, the sleep and the exit code apply only while PARALLAX_RESTART_COUNT < A
(later attempts exit 0 at once). With --checkpoint-every S (an elastic job's worker, for
`parallax run --host-discovery-script`), the sleep is cut into "checkpoints" S seconds apart:
at each, rank 0 stops for a rescale when the launcher asked for one (PARALLAX_RESCALE_FILE:
it notes the stop, prints {"rescale_stop": 1, ...} and exits 75, as
parallax.tf.state.rescale does), and the other ranks exit 75 once rank 0 noted it. The probe's
line also says what the request file held when it started ("asked").
"""
import argparse
import json
import os
import sys
import time

WARM = "tensorflow" in sys.modules  # forked from a warm process (parallax.launch.warm)
parser = argparse.ArgumentParser()
parser.add_argument("--exit", type=int, default=0)
parser.add_argument("--exit-rank", type=int, default=None)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--until-restart", type=int, default=None)
parser.add_argument("--collective", action="store_true")
parser.add_argument("--checkpoint-every", type=float, default=None)
args = parser.parse_args()
restart = int(os.environ.get("PARALLAX_RESTART_COUNT", "0"))
if args.until_restart is not None and restart >= args.until_restart:
    args.sleep, args.exit = 0.0, 0

rank, size = 0, 1
if "HOROVOD_SIZE" in os.environ:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
elif os.environ.get("PARALLAX_WORKERS"):
    rank = int(os.environ["PARALLAX_WORKER_RANK"])
    size = len(os.environ["PARALLAX_WORKERS"].split(","))
total = None
if args.collective:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from parallax.tf.collectives import make_collectives

    [summed] = make_collectives().allreduce_sum([tf.constant([rank + 1.0])])
    total = float(summed.numpy()[0])

from parallax import PSClient  # noqa: E402
from parallax.client.connection import client_options_from_env  # noqa: E402
from parallax.env import (RESCALE_EXIT, RESCALE_FILE_ENV, note_rescale_stop,  # noqa: E402
                          rescale_request)

rescale_file = os.environ.get(RESCALE_FILE_ENV)

addresses = os.environ["PARALLAX_PS_ADDRESSES"].split(",")
with PSClient(addresses, client_options_from_env()) as client:
    client.wait_ready(30)
print(json.dumps({"probe": 1, "rank": rank, "size": size, "addresses": addresses,
                  "run_id": os.environ["PARALLAX_RUN_ID"], "pid": os.getpid(),
                  "netns": os.readlink("/proc/self/ns/net"),
                  "mode": os.environ.get("PARALLAX_MODE"),
                  "sync": os.environ.get("PARALLAX_SYNC"), "restart": restart, "sum": total,
                  "replicas": os.environ.get("PARALLAX_REPLICAS"),
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "log_level": os.environ.get("PARALLAX_LOG_LEVEL"), "warm": WARM,
                  "asked": rescale_request(rescale_file) if rescale_file else None}),
      flush=True)


def sleep_to_checkpoints(seconds: float) -> None:
    """Sleep; stop for a rescale at a checkpoint every --checkpoint-every seconds when
    asked (rank 0 decides; the others follow its note)."""
    end, checkpoint = time.monotonic() + seconds, time.monotonic() + args.checkpoint_every
    while time.monotonic() < end:
        time.sleep(0.05)
        if rank and os.path.exists(f"{rescale_file}.stopped"):
            sys.exit(RESCALE_EXIT)
        if rank == 0 and time.monotonic() >= checkpoint:
            checkpoint += args.checkpoint_every
            if rescale_request(rescale_file) is not None:
                note_rescale_stop(rescale_file, 0)
                print(json.dumps({"rescale_stop": 1, "size": size,
                                  "asked": rescale_request(rescale_file)}), flush=True)
                sys.exit(RESCALE_EXIT)


if args.checkpoint_every is not None and rescale_file and args.exit_rank != rank:
    sleep_to_checkpoints(args.sleep)
else:
    time.sleep(0.0 if args.exit_rank == rank else args.sleep)
sys.exit(args.exit if args.exit_rank in (None, rank) else 0)
