"""Launch backends: how `parallax run` starts the workers of one attempt (an extension point).

A backend makes the one command that the launcher runs, in its own process group, for all
of a job's workers (`argv`), and reads what that command writes about them (`rank_line`,
`failure`). `choose` picks the first backend in `BACKENDS` whose `accepts` takes the job:

  single      one worker on this machine: the program itself (`single.py`)
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

if TYPE_CHECKING:
    from parallax.launch.hosts import ClusterLayout

BACKENDS: dict[str, WorkerBackend] = {b.name: b for b in (Single(), Horovodrun())}


def choose(layout: ClusterLayout, num_workers: int) -> WorkerBackend:
    """The first backend that accepts the job (horovodrun accepts every layout)."""
    for backend in BACKENDS.values():
        if backend.accepts(layout, num_workers):
            return backend
    raise ConfigError(f"no launch backend ({', '.join(BACKENDS)}) can start {num_workers} "
                      f"worker(s) on hosts {[h.host for h in layout.hosts]}")
