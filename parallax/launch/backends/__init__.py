"""Launch backends: how `parallax run` starts the workers of one attempt (an extension point).

A backend makes the one command that the launcher runs, in its own process group, for all
of a job's workers (`argv`), and reads what that command writes about them (`rank_line`,
`failure`). `choose` picks the first backend in `BACKENDS` whose `accepts` takes the job:

  single      one worker on this machine: the program itself (`single.py`)
  tensorflow  N workers here and over ssh without Horovod, through a small supervisor;
              their dense gradients go through TensorFlow's collectives (`tfrun.py`)
  horovodrun  N workers here and over ssh, through Horovod's launcher with gloo
              (`horovodrun.py`)

The launcher owns what is the same for every backend: the servers, the workers' environment
(`parallax.env`), signals, health checks, restarts and the exit code. A new backend (Slurm's
`srun`, say) is one module with a `WorkerBackend` subclass, put in `BACKENDS` before those it
should win over.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from parallax.errors import ConfigError
from parallax.launch.backends.base import WorkerBackend
from parallax.launch.backends.horovodrun import Horovodrun
from parallax.launch.backends.single import Single
from parallax.launch.backends.tfrun import TensorFlowRun

if TYPE_CHECKING:
    from parallax.launch.hosts import ClusterLayout

BACKENDS: dict[str, WorkerBackend] = {b.name: b for b in (Single(), TensorFlowRun(),
                                                           Horovodrun())}


def choose(layout: ClusterLayout, num_workers: int, collectives: str = "auto"
           ) -> WorkerBackend:
    """The first backend that accepts the job: with `collectives` "auto", horovodrun where
    Horovod is installed, else the TensorFlow supervisor."""
    for backend in BACKENDS.values():
        if backend.accepts(layout, num_workers, collectives):
            return backend
    raise ConfigError(f"no launch backend ({', '.join(BACKENDS)}) can start {num_workers} "
                      f"worker(s) on hosts {[h.host for h in layout.hosts]}")
