"""Network bytes and CPU seconds over time, so they can be charged to measurement windows.

Why: a benchmark worker reports its measurement windows (after warm-up, excluding the
checkpoint at the end) as wall-clock `time.time()` intervals, but the bytes each host sent and
the CPU every benchmark process burnt are only available as running totals. A background
thread samples the totals every `interval` seconds; `between(t0, t1)` interpolates the totals
linearly at both ends of a window and subtracts, so a window is charged what happened inside
it (to within the change over one interval at either edge) without the worker having to read
counters itself. The interpolation is a pure function (`window_usage`) over a list of
`Sample`s so it can be tested with synthetic numbers. Given `labels` (pid -> host), CPU
seconds are also kept per host (`cpu_by_host`), so a report can tell a worker's CPU from a
server's.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from parallax.errors import ConfigError

Counters = Callable[[], dict[str, tuple[int, int]]]
Labels = Callable[[], Mapping[int, str]]
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sample:
    """The running totals at wall-clock time `t`: CPU seconds of all sampled processes and,
    per host, (bytes sent, bytes received) and CPU seconds (labelled processes only)."""

    t: float
    cpu_seconds: float
    bytes: dict[str, tuple[float, float]]
    cpu_by_host: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowUsage:
    """What was used within one window: its length, the CPU seconds all benchmark processes
    used in it, and per host the bytes it sent and received in it and its CPU seconds."""

    seconds: float
    cpu_seconds: float
    bytes: dict[str, tuple[float, float]]
    cpu_by_host: dict[str, float] = field(default_factory=dict)


def _lerp(a: float, b: float, f: float) -> float:
    return a + (b - a) * f


def interpolate(samples: Sequence[Sample], t: float) -> Sample:
    """The totals at time t, linear between the two samples around it. samples must be sorted
    by time; t must lie within [first, last] sample time (no extrapolation: a guess past the
    last sample could charge a window bytes that were never sent)."""
    if not samples:
        raise ConfigError("no samples yet: start the sampler before the window begins")
    first, last = samples[0].t, samples[-1].t
    if not first <= t <= last:
        raise ConfigError(f"time {t:.3f} is outside the sampled range [{first:.3f}, {last:.3f}]; "
                          "start the sampler before the window and stop it after")
    i = bisect.bisect_left(samples, t, key=lambda s: s.t)
    if samples[i].t == t or i == 0:
        return samples[i]
    lo, hi = samples[i - 1], samples[i]
    f = (t - lo.t) / (hi.t - lo.t)
    hosts = lo.bytes.keys() & hi.bytes.keys()
    # A host first seen at `hi` had no process yet at `lo`: it had used nothing.
    return Sample(t=t, cpu_seconds=_lerp(lo.cpu_seconds, hi.cpu_seconds, f),
                  bytes={h: (_lerp(lo.bytes[h][0], hi.bytes[h][0], f),
                             _lerp(lo.bytes[h][1], hi.bytes[h][1], f)) for h in hosts},
                  cpu_by_host={h: _lerp(lo.cpu_by_host.get(h, 0.0), c, f)
                               for h, c in hi.cpu_by_host.items()})


def window_usage(samples: Sequence[Sample], t0: float, t1: float) -> WindowUsage:
    """Usage between t0 and t1 (t0 <= t1), both within the sampled range."""
    if t1 < t0:
        raise ConfigError(f"window end {t1:.3f} is before its start {t0:.3f}")
    start, end = interpolate(samples, t0), interpolate(samples, t1)
    hosts = sorted(start.bytes.keys() & end.bytes.keys())
    return WindowUsage(seconds=t1 - t0, cpu_seconds=end.cpu_seconds - start.cpu_seconds,
                       bytes={h: (end.bytes[h][0] - start.bytes[h][0],
                                  end.bytes[h][1] - start.bytes[h][1]) for h in hosts},
                       cpu_by_host={h: c - start.cpu_by_host.get(h, 0.0)
                                    for h, c in sorted(end.cpu_by_host.items())})


def process_cpu_seconds(pid: int) -> tuple[int, float] | None:
    """(start time in ticks, utime + stime in seconds) of pid from /proc/PID/stat, None if it
    is gone. The start time tells a reused pid from the process that had it before.
    Children's time is not included: the sampler is given every benchmark process itself."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    fields = stat.rpartition(")")[2].split()
    # fields[0] is field 3 of stat: utime 14, stime 15, starttime 22.
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


class ResourceSampler:
    """Samples `counters()` (host -> (sent, received) bytes; None: no network) and the CPU
    time of `pids()` every `interval` seconds in a daemon thread. A process that exits keeps
    the CPU seconds it had at its last sample, so the total never goes backwards.
    labels (pid -> host name, optional): CPU seconds are also summed per host.
    Use as a context manager or start()/stop()."""

    def __init__(self, counters: Counters | None, pids: Callable[[], Iterable[int]],
                 interval: float = 0.2, labels: Labels | None = None) -> None:
        if interval <= 0:
            raise ConfigError(f"sampling interval {interval!r} must be > 0 seconds")
        self._counters = counters
        self._pids = pids
        self._labels = labels
        self.interval = interval
        self._cpu: dict[tuple[int, int], float] = {}  # (pid, start time) -> CPU seconds
        self._host: dict[tuple[int, int], str] = {}   # (pid, start time) -> its label
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> ResourceSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ResourceSampler:
        """Take the first sample now (so a window starting right after start() is covered)."""
        self._record()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="resource-sampler",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a last sample, so a window ending before stop() is
        covered."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.error is None:
            self._record()

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def between(self, t0: float, t1: float) -> WindowUsage:
        """Usage within [t0, t1] (time.time() values) by linear interpolation."""
        try:
            return window_usage(self.samples(), t0, t1)
        except ConfigError as err:
            if self.error is not None:
                raise ConfigError(f"{err} (sampling stopped early: {self.error!r})") from err
            raise

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._record()
            except Exception as err:  # noqa: BLE001 - kept and reported by between()
                self.error = err
                return

    def _record(self) -> None:
        # The clock is read between the two reads, so its error is half the time they take.
        network = dict(self._counters()) if self._counters else {}
        t = time.time()
        labels = dict(self._labels()) if self._labels else {}
        for pid in self._pids():
            found = process_cpu_seconds(pid)
            if found is not None:
                self._cpu[(pid, found[0])] = found[1]
                if pid in labels:
                    self._host[(pid, found[0])] = labels[pid]
        by_host: dict[str, float] = {}
        for key, host in self._host.items():
            by_host[host] = by_host.get(host, 0.0) + self._cpu[key]
        sample = Sample(t=t, cpu_seconds=sum(self._cpu.values()),
                        bytes={h: (float(s), float(r)) for h, (s, r) in network.items()},
                        cpu_by_host=by_host)
        with self._lock:
            if not self._samples or t > self._samples[-1].t:
                self._samples.append(sample)
