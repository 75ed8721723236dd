"""Keep freed message-sized buffers for reuse instead of returning them to the kernel.

Every pull and push allocates buffers of a few MB. glibc's malloc hands blocks above its
(dynamic) mmap threshold back to the kernel on free, so the next request pays a page fault
per 4 KiB page: measured here as about 30% of a server's CPU time on large requests. Fixing
the threshold at 32 MiB and raising the trim threshold lets freed buffers be reused.

A server also caps its malloc arenas (`arenas`): each thread that allocates may otherwise get
an arena of its own (up to 8 per core), and a buffer freed in one arena is never reused by a
thread of another, so a burst of requests on many data-plane threads left freed buffers
resident in every arena (measured: six refused 16 MB pulls at once left 175 MB more resident
with the default arenas, 60 MB with two).
"""
from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def reuse_freed_memory(mmap_threshold_mb: int = 32, trim_threshold_mb: int = 1024,
                       arenas: int | None = None) -> bool:
    """Apply to this process (`arenas`: at most that many malloc arenas); False where the C
    library is not glibc (nothing changes)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold_mb << 20)
    ok = ok and mallopt(_M_TRIM_THRESHOLD, trim_threshold_mb << 20)
    return bool(ok and (arenas is None or mallopt(_M_ARENA_MAX, arenas)))


def return_freed_memory() -> bool:
    """Hand freed heap memory back to the kernel now (after a one-off burst such as streaming
    a table's initial values); False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
