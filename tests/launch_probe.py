"""A worker for `parallax run` tests: reports what the launcher gave it, as one JSON line.

Initialises horovod.tensorflow when HOROVOD_SIZE is set (under horovodrun), waits until
every server in PARALLAX_PS_ADDRESSES is serving, prints {"probe": 1, "rank", "size",
"addresses", "run_id", "pid", "netns", "mode", "sync", "restart", "cuda" (CUDA_VISIBLE_DEVICES),
"log_level" (PARALLAX_LOG_LEVEL)}, optionally sleeps, and
exits with --exit CODE (only on --exit-rank R when given; the other ranks exit 0). With
--until-restart A, the sleep and the exit code apply only while PARALLAX_RESTART_COUNT < A
(later attempts exit 0 at once).
"""
import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--exit", type=int, default=0)
parser.add_argument("--exit-rank", type=int, default=None)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--until-restart", type=int, default=None)
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

from parallax import PSClient  # noqa: E402
from parallax.client.connection import client_options_from_env  # noqa: E402

addresses = os.environ["PARALLAX_PS_ADDRESSES"].split(",")
with PSClient(addresses, client_options_from_env()) as client:
    client.wait_ready(30)
print(json.dumps({"probe": 1, "rank": rank, "size": size, "addresses": addresses,
                  "run_id": os.environ["PARALLAX_RUN_ID"], "pid": os.getpid(),
                  "netns": os.readlink("/proc/self/ns/net"),
                  "mode": os.environ.get("PARALLAX_MODE"),
                  "sync": os.environ.get("PARALLAX_SYNC"), "restart": restart,
                  "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "log_level": os.environ.get("PARALLAX_LOG_LEVEL")}), flush=True)
time.sleep(args.sleep)
sys.exit(args.exit if args.exit_rank in (None, rank) else 0)
