"""Where an elastic job's workers stop for a new worker count: right after a checkpoint.

`parallax run --host-discovery-script` (parallax.launch.elastic) asks for another worker
count by writing it to the file named by PARALLAX_RESCALE_FILE. Keras `fit` calls
`stop_if_asked` at the end of every epoch, after its callbacks (`BackupAndRestore` saves
there); a custom loop calls `ParallaxStrategy.rescale_point()` after its checkpoint. When the
launcher asked, and this point followed a checkpoint, every worker stops there together (the
chief decides and notes it for the launcher, then the others follow its broadcast: a worker
that exits first ends the others, so the note comes before), and each worker ends with exit
code `RESCALE_EXIT`. The launcher then starts the job again with
the new count, which resumes from that checkpoint: nothing is redone, and each step still
consumes the same global batch (`datasets.shard_for_worker` splits it by the new count).
`parallax run --replicas 2` asks the same way, with the same count, after a server died:
the job goes on from that checkpoint with every server again (the lost one started anew,
the copies of its shards restored).
"""
from __future__ import annotations

import logging
import math
import os

from parallax.env import (ELASTIC_ENV, RESCALE_AT_START, RESCALE_EXIT, RESCALE_FILE_ENV,
                          global_batch, note_global_batch, note_rescale_stop, rescale_reason,
                          rescale_request)

log = logging.getLogger("parallax")
_warned: set[str] = set()


def elastic() -> bool:
    """Whether this worker runs in an elastic job (PARALLAX_ELASTIC=1): its count may
    change, so its chief notes the global batch."""
    return os.environ.get(ELASTIC_ENV) == "1" and stoppable()


def stoppable() -> bool:
    """Whether the launcher may ask this worker to stop at its next checkpoint
    (PARALLAX_RESCALE_FILE set: an elastic job, or one whose servers keep copies)."""
    return bool(os.environ.get(RESCALE_FILE_ENV))


def stop_if_asked(extended, saved: bool, at: str, last: bool = False,
                  warn: bool = True) -> None:
    """At a point every worker reaches together (`at`: where, "epoch 3", "step 20"): raise
    SystemExit with RESCALE_EXIT on every worker when the launcher asked for another worker
    count and the chief `saved` a checkpoint just before; `last`: the job's training ends
    here anyway (no stop); `warn`: say once when asked where nothing was saved. Without
    PARALLAX_RESCALE_FILE (no elastic launcher), nothing."""
    path = os.environ.get(RESCALE_FILE_ENV)
    if not path:
        return
    workers = extended.workers
    stop = workers.info.is_chief and _chief_stops(path, workers.info.size, saved, last, warn)
    if stop:  # noted before the others learn it: the first of them to exit ends the job
        note_rescale_stop(path, at)
        log.info("stopping after the checkpoint at %s: the launcher asked for %s", at,
                 _asked(path, workers.info.size))
    if workers.info.size > 1:
        stop = workers.broadcast_object(stop if workers.info.is_chief else None)
    if stop:
        raise SystemExit(RESCALE_EXIT)


def publish_global_batch(workers, batch) -> None:
    """The chief of an elastic job notes its training data's global batch for the launcher,
    which then starts only worker counts that split it evenly (several datasets: the
    greatest common divisor of their batches, which every count that splits it splits);
    `batch`: a callable (read only in an elastic job: it may peek at the data). When this
    count does not split it (the first attempt, started before the note), every worker
    stops here, before its first step, as for a new count (RESCALE_EXIT, the chief's note
    first): the launcher goes on with one that splits it, where every worker would have
    failed at its first step (without --max-restarts, the job's end)."""
    path = os.environ.get(RESCALE_FILE_ENV)
    if not path or not elastic():
        return
    value, size = batch(), workers.info.size
    if workers.info.is_chief:
        noted = global_batch(path)
        note_global_batch(path, math.gcd(noted, value) if noted else value)
    if not value % size:
        return
    if workers.info.is_chief:  # noted before the others learn it, as in stop_if_asked
        note_rescale_stop(path, RESCALE_AT_START)
        log.warning("the global batch of %d does not split evenly among %d workers: "
                    "stopping before the first step, for the launcher to go on with a count "
                    "that splits it", value, size)
    workers.broadcast_object(True if workers.info.is_chief else None)  # (every worker: the
    raise SystemExit(RESCALE_EXIT)                      # same batch, so the same decision)


def _chief_stops(path: str, size: int, saved: bool, last: bool, warn: bool) -> bool:
    wanted = rescale_request(path)  # (the count may be this one: a host was replaced)
    if wanted is None or last:
        return False
    if not saved:
        if warn and path not in _warned:
            _warned.add(path)
            log.warning("the launcher asks for %s, but no checkpoint was saved here: going "
                        "on with %d worker(s) until one is (save at every epoch's end, e.g. "
                        "keras.callbacks.BackupAndRestore, or call strategy.rescale_point() "
                        "after a save)", _asked(path, size), size)
        return False
    return True


def _asked(path: str, size: int) -> str:
    """What the launcher's request is for, in words."""
    why = rescale_reason(path)
    return why or f"{rescale_request(path)} worker(s) instead of {size}"
