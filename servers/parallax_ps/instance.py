"""--restore-newest-on-restart INSTANCE: restore newest only when started again in place.

A server that an orchestrator restarts by itself (a Kubernetes pod's container: the same
command every time, `parallax k8s --replay-mb`) cannot be given --restore-newest for its
restarts only, and --restore-newest on its first start could fill its shards from
checkpoints of an earlier run left in the data directory (a retained volume, a job run
again under the same name) without any worker checking them: a worker checks what a server
restored only when it rebuilds a replacement. So the server is told its instance (a
pod's uid, the same across its container's restarts, another for a new pod) and keeps a
small marker in its data directory:

- the first start of an instance there writes the marker: the instance and every
  complete checkpoint under the data directory then; its shards are created fresh;
- a start again of the same instance (the marker names it) restores each shard created
  from the newest complete checkpoint of its table, as --restore-newest does, but never
  from one the marker lists: only checkpoints saved since the instance's first start.

A damaged marker counts as none: a first start (fresh shards; a worker then refuses to
replay onto them, loudly)."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from parallax_ps import versions

log = logging.getLogger("parallax_ps")
MARKER_PREFIX = ".instance-"  # <data dir>/.instance-<sha256(instance)[:16]>.json


@dataclass(frozen=True)
class Start:
    restarted: bool           # the marker named this instance: restore newest
    before: frozenset[str]    # checkpoints (relative to the data dir) never restored


def marker_path(data_dir: Path, instance: str) -> Path:
    digest = hashlib.sha256(instance.encode()).hexdigest()[:16]
    return data_dir / f"{MARKER_PREFIX}{digest}.json"


def _noted(path: Path, instance: str) -> list[str] | None:
    """The checkpoints the marker lists, if it is this instance's; else None."""
    try:
        noted = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("instance marker %s is unreadable (%s): a first start", path, err)
        return None
    if not isinstance(noted, dict) or noted.get("instance") != instance \
            or not isinstance(noted.get("before"), list):
        return None
    before = noted["before"]
    return [str(b) for b in before]


def begin(data_dir: Path, instance: str) -> Start:
    """Whether this start of `instance` is a start again on `data_dir`, and the
    checkpoints it must not restore; a first start writes the marker (before serving)."""
    path = marker_path(data_dir, instance)
    before = _noted(path, instance)
    if before is not None:
        log.info("instance %s started again: shards restore from their newest checkpoint "
                 "saved since its first start (%d older ones skipped)", instance, len(before))
        return Start(True, frozenset(before))
    found = sorted(str(p.relative_to(data_dir)) for p in versions.complete_under(data_dir))
    body = json.dumps({"instance": instance, "before": found}).encode()
    versions.atomic_write(path, lambda f: f.write(body))
    log.info("instance %s first started here: shards created fresh (%d checkpoints there "
             "will never be restored by its restarts)", instance, len(found))
    return Start(False, frozenset(found))
