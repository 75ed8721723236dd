"""The `tensorflow` launch backend: N workers on this machine, without Horovod, whose dense
gradients go through TensorFlow's own collectives (`parallax.tf.tf_collectives`).

Its one command is a small supervisor, `tf_supervisor.py` beside this file, which keeps
horovodrun's output contract: the launcher reads both alike.
"""
from __future__ import annotations

import sys

from parallax.errors import ConfigError
from parallax.launch.backends.base import WorkerBackend
from parallax.launch.backends.horovodrun import Horovodrun, horovod_installed
from parallax.launch.hosts import ClusterLayout, is_local, worker_hosts

SUPERVISOR = "parallax.launch.backends.tf_supervisor"


class TensorFlowRun(WorkerBackend):
    name = "tensorflow"
    who = "the workers (parallax's TensorFlow supervisor)"

    def accepts(self, layout: ClusterLayout, num_workers: int, collectives: str = "auto"
                ) -> bool:
        """Several workers, all on this machine, asked for (or Horovod is not installed)."""
        if collectives == "horovod" or (collectives == "auto" and horovod_installed()):
            return False
        return all(is_local(host.host) for host, _, _ in worker_hosts(layout, num_workers))

    def argv(self, layout: ClusterLayout, num_workers: int, program: list[str],
             extra_args: tuple[str, ...] = ()) -> list[str]:
        if extra_args:
            raise ConfigError(f"--horovodrun-arg {' '.join(extra_args)}: the workers start "
                              f"without horovodrun (--collectives tensorflow, or Horovod "
                              f"missing); drop it, or use --collectives horovod")
        return [sys.executable, "-m", SUPERVISOR, "-np", str(num_workers), "--host",
                "127.0.0.1", "--", *program]  # (every worker is on this machine: accepts)

    rank_line = Horovodrun.rank_line  # the same output contract as horovodrun's
    failure = Horovodrun.failure

