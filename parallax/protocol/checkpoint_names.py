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


def new_name() -> str:
    """A fresh checkpoint name, later than every name made before on this clock."""
    return f"ckpt-{time.time_ns():020d}-{secrets.token_hex(4)}"


def is_name(text: str) -> bool:
    return bool(PATTERN.match(text))
