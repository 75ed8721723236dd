"""A strategy made in a real cgroup v1 CPU group of half a core (below the visible cores)
gives TensorFlow's pools two inter-op threads and one intra-op thread and logs why;
TF_NUM_INTEROP_THREADS, or a pool the program sized itself, leaves them to the user; a
strategy made after TensorFlow's runtime started says it is too late."""
from __future__ import annotations

import os
import subprocess
import sys

from parallax.bench.cgroups import CpuGroups, available

SCRIPT = r"""
import sys
import tensorflow as tf
if sys.argv[1] == "late":
    tf.constant(1.0) + 1.0  # starts TensorFlow's runtime before the strategy
if sys.argv[1] == "chosen":
    tf.config.threading.set_intra_op_parallelism_threads(3)
import parallax
strategy = parallax.ParallaxStrategy("allreduce")
print("POOLS", tf.config.threading.get_inter_op_parallelism_threads(),
      tf.config.threading.get_intra_op_parallelism_threads(), flush=True)
"""


VISIBLE = len(os.sched_getaffinity(0))
BASE_ENV = {k: v for k, v in os.environ.items()
            if k not in ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")}


def _run(groups: CpuGroups, host: str, mode: str, **env: str) -> tuple[str, str]:
    done = subprocess.run(groups.exec_prefix(host) + [sys.executable, "-c", SCRIPT, mode],
                          capture_output=True, text=True, timeout=600,
                          env={**BASE_ENV, "TF_CPP_MIN_LOG_LEVEL": "2", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    pools = [line for line in done.stdout.splitlines() if line.startswith("POOLS")]
    return pools[0], done.stderr


def test_a_half_core_container_gets_small_pools():
    assert available() is None, available()
    assert VISIBLE >= 2, "a quota below the visible cores needs two of them"
    with CpuGroups(0.5, "pxq") as groups:
        pools, log = _run(groups, "a", "early")
        assert pools == "POOLS 2 1", log
        assert "TensorFlow thread pools: 2 inter-op and 1 intra-op threads (this process's " \
               f"CPU quota is 0.5 cores of the {VISIBLE} " in log
        pools, log = _run(groups, "b", "early", TF_NUM_INTEROP_THREADS="2")
        assert pools == "POOLS 0 0" and "thread pools" not in log  # TF reads it itself
        pools, log = _run(groups, "d", "chosen")  # the program's own choice stays
        assert pools == "POOLS 0 3" and "thread pools" not in log
        pools, log = _run(groups, "c", "late")
        assert pools == "POOLS 0 0"
        assert "TensorFlow's thread pools were made before the strategy" in log
