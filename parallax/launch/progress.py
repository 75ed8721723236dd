"""Job-level progress for `parallax run`: every few seconds, one line read from the servers'
Stats (the job's tables, their step, rows pulled and pushed, and the rate since the last line).

The servers see every step of every worker, so this needs nothing from the workers and works
the same for one machine, several hosts, or external servers.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from parallax.client import ClientOptions, PSClient
from parallax.errors import ParallaxError


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


class ProgressReporter:
    """Prints `progress` lines until stopped; a failed read is reported, never raised."""

    def __init__(self, addresses: list[str], run_id: str, interval: float,
                 say: Callable[[str], None], options: ClientOptions | None = None) -> None:
        self.addresses = list(addresses)
        self.prefix = f"{run_id}."
        self.interval = interval
        self.say = say
        self.options = options or ClientOptions(timeout=5, retries=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="parallax-progress", daemon=True)
        self._start = time.monotonic()
        self._last: tuple[float, int, int] | None = None
        # (pulled, pushed) rows per (server, table) as last read: a server lost (replicated
        # shards) keeps what it counted, so that the totals never go back
        self._counted: dict[tuple[str, str], tuple[int, int]] = {}
        self._client: PSClient | None = None  # one for the job: a lost server is left out

    def start(self) -> "ProgressReporter":
        if self.interval > 0 and self.addresses:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._client is not None and not self._thread.is_alive():
            self._client.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.say(self.snapshot())
            except ParallaxError as exc:
                self.say(f"progress: the servers did not answer ({exc})")

    def snapshot(self) -> str:
        """One line: elapsed time, each table's step (lowest shard), rows moved and rates."""
        if self._client is None:
            self._client = PSClient(self.addresses, self.options)
        replies = self._client.stats()
        steps: dict[str, int] = {}
        for address, reply in replies.items():
            for table in reply.tables:
                if not table.table.startswith(self.prefix):
                    continue
                name = table.table[len(self.prefix):]
                steps[name] = min(steps.get(name, table.step), table.step)
                # a table's counts are the server's, repeated with each shard it holds
                self._counted[(address, name)] = (
                    sum(m.rows for m in table.methods if m.method in ("Pull", "PullMany")),
                    sum(m.rows for m in table.methods if m.method in ("Push", "PushMany")))
        pulled = sum(p for p, _ in self._counted.values())
        pushed = sum(p for _, p in self._counted.values()) // self.options.replicas  # copies
        now = time.monotonic()
        elapsed = f"{int(now - self._start) // 60}m{int(now - self._start) % 60:02d}s"
        if not steps:
            return f"progress {elapsed}: no tables on the servers yet (dense-only, or starting)"
        rate = ""
        if self._last is not None and now > self._last[0]:
            seconds = now - self._last[0]
            rate = (f" ({_count((pulled - self._last[1]) / seconds)}/s pulled, "
                    f"{_count((pushed - self._last[2]) / seconds)}/s pushed)")
        self._last = (now, pulled, pushed)
        tables = ", ".join(f"{name} step {step}" for name, step in sorted(steps.items()))
        return (f"progress {elapsed}: {tables}; rows pulled {_count(pulled)}, "
                f"pushed {_count(pushed)}{rate}")
