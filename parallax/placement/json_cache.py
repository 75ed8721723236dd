"""The placement's on-disk caches (the planner's plans, the partition search's
decisions): a file named by the sha256 of what its content depends on, written atomically so
that a crash or a full disk leaves the previous file or none, never half of one."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def cache_path(root: Path | str, key, digits: int = 64) -> Path:
    """`root/<sha256 of key as canonical JSON, its first digits>.json`."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return Path(root) / f"{hashlib.sha256(text.encode()).hexdigest()[:digits]}.json"


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file in its directory (removed on failure)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
