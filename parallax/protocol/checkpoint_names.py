"""Names of checkpoint directories: `ckpt-<UTC nanoseconds, 20 digits>-<8 hex digits>`.

The client names each save; the name sorts by age, so "the newest checkpoint" is the last
name in sorted order, on every server, whether or not they share a data directory.
"""
from __future__ import annotations

import re
import secrets
import time

PATTERN = re.compile(r"^ckpt-\d{20}-[0-9a-f]{8}$")
# How a server without --data-dir refuses a Save or Restore (FAILED_PRECONDITION): the start
# of its message, stable, so a client can tell this refusal from a failing disk.
NO_DATA_DIR = "this server has no data directory"


# How a server refuses to commit a checkpoint that would not be the newest under its path
# (FAILED_PRECONDITION): this phrase, then the newer name. A client whose clock is behind
# the host's that named that one names its next save after it (`new_name(after=...)`).
SORTS_BEFORE = "would sort before the existing"
_LATEST_NS = 10 ** 20 - 1  # the largest time a name can carry (20 digits)


def new_name(after: str = "") -> str:
    """A fresh checkpoint name, later than every name made before on this clock and than
    checkpoint `after` (one named on another host's clock, which may be ahead of ours: a
    chief moved to another host resumes from it and saves next)."""
    now = time.time_ns()
    if is_name(after):
        now = max(now, min(_nanoseconds(after) + 1, _LATEST_NS))
    return f"ckpt-{now:020d}-{secrets.token_hex(4)}"


def newer_named(message: str) -> str:
    """The newer checkpoint a SORTS_BEFORE refusal names ("" for any other message), when
    a name can still sort after it."""
    match = re.search(re.escape(SORTS_BEFORE) + r" (ckpt-\d{20}-[0-9a-f]{8})", message)
    return match.group(1) if match and _nanoseconds(match.group(1)) < _LATEST_NS else ""


def _nanoseconds(name: str) -> int:
    return int(name[len("ckpt-"):len("ckpt-") + 20])


def is_name(text: str) -> bool:
    return bool(PATTERN.match(text))
