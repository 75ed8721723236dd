"""Dense collectives between workers (extension point `BACKENDS`): Horovod's ring all-reduce
when launched by horovodrun (`horovod.py`), TensorFlow's own collective ops when launched
without Horovod (`tensorflow.py`), identity for a single worker (`single.py`).

The strategy only needs six things from its peers, the interface `workers.Workers` every
backend implements: who am I, sum these gradients (as one fused group, in the graph),
all-gather sparse gradients (the `allreduce` run mode), gather predictions
(`allgather_rows`), copy rank 0's variables, and exchange small Python objects (plans, to
check that workers agree). A new backend is one module implementing it and one entry in
`BACKENDS` (and its name in `parallax.env.COLLECTIVES`, which the launcher checks too).
"""
from __future__ import annotations

import os

from parallax.env import COLLECTIVES
from parallax.errors import ConfigError
from parallax.tf.collectives.horovod import HorovodWorkers, launched_by_horovod
from parallax.tf.collectives.single import SingleWorker
from parallax.tf.collectives.tensorflow import TensorFlowWorkers, collective_workers
from parallax.tf.collectives.workers import Workers

# name -> the backend (each implements `Workers`); `parallax.env.COLLECTIVES` is the names a
# user may choose ("auto" besides: `make_collectives` picks)
BACKENDS: dict[str, type[Workers]] = {"horovod": HorovodWorkers, "tensorflow": TensorFlowWorkers,
                                      "single": SingleWorker}


def make_collectives(kind: str = "auto", environ: dict[str, str] | None = None) -> Workers:
    """The peers of this worker. `kind`: "horovod" (Horovod, as horovodrun or mpirun started
    it), "tensorflow" (TensorFlow's collectives among the workers `parallax run` or TF_CONFIG
    names) or "auto": Horovod when this process was launched by it, else TensorFlow's when
    several workers are named, else a single worker."""
    environ = os.environ if environ is None else environ
    if kind not in COLLECTIVES:
        raise ConfigError(f"collectives {kind!r} is not one of {', '.join(COLLECTIVES)}")
    by_horovod = launched_by_horovod(environ)
    workers = None if by_horovod else collective_workers(environ)
    if kind == "tensorflow" and by_horovod:
        raise ConfigError("collectives='tensorflow', but horovodrun (or mpirun) started this "
                          "worker: each worker would train alone. Start the job with `parallax "
                          "run --collectives tensorflow`, or use collectives='auto'")
    if kind == "horovod" and workers:
        raise ConfigError(f"collectives='horovod', but parallax run's TensorFlow backend (or "
                          f"TF_CONFIG) started this worker, one of {len(workers[0])}, without "
                          f"Horovod: each worker would train alone. Start the job with `parallax "
                          f"run --collectives horovod`, or use collectives='auto'")
    if kind == "horovod" or by_horovod:
        return BACKENDS["horovod"]()
    return BACKENDS["tensorflow"](*workers) if workers else BACKENDS["single"]()
