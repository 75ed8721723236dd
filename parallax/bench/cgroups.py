"""CPU isolation for benchmark processes: one cgroup v1 `cpu` group per process.

Why: on the 2-core development machine every process of an emulated cluster (workers,
parameter servers, a TF coordinator) shares the same cores, so a busy server slows the
workers and the benchmark measures CPU contention as much as the network. Here each process
(each "host" of a run) gets its own group `{root}/{prefix}-{host}` whose CFS quota holds it
to `share` cores (`cpu.cfs_quota_us = share * cpu.cfs_period_us`, period 100 ms), as if each
host were a machine of its own with `share` of a core.

How a process joins its group before it does any work: `exec_prefix(host)` returns
`sh -c 'echo $$ > GROUP/cgroup.procs && exec "$@"'`, put in front of the command (and in
front of `ip netns exec`, which remounts /sys and would hide /sys/fs/cgroup); the shell moves
itself into the group, then becomes the command, and everything the command starts inherits
the group. `add(host, pid)` moves a process that is already running.

Groups are removed (after their remaining processes are killed) by `remove_all()`, by
`__exit__`, at interpreter exit (atexit), and by `sweep(prefix)` for leftovers of a run that
was killed; `available()` says why isolation cannot work here (no cgroup v1 cpu hierarchy at
`root`, or not writable). `root` is a parameter everywhere, so a test can point the module at
a directory that is not a cgroup hierarchy.

The links: a process held to `share` of a core does its work `1/share` times slower, so the
benchmark scales each link's bandwidth by `share` too (and its latency by 1/share):
`scaled_link`. Each process is then "one core with a 1 Gbit/s NIC, scaled by the share",
the compute-to-network ratio of a real cluster of one-core hosts.
"""
from __future__ import annotations

import atexit
import os
import re
import time
from pathlib import Path

from parallax.bench.netns import LinkSpec, kill_all
from parallax.errors import ConfigError, ParallaxError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000          # the kernel's default CFS period
UNLIMITED = -1               # cpu.cfs_quota_us: no quota
MIN_SHARE = 0.01             # quota >= 1 ms per 100 ms period (the kernel's minimum)
KILL_GRACE_S = 2.0
SHARED = ("off", "shared", "none")  # --cpu-share words for "no isolation"
_JOIN = 'echo $$ > "$1/cgroup.procs" || exit 125; shift; exec "$@"'
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class CgroupError(ParallaxError):
    """Creating, filling or removing a CPU group failed; names the path and the error."""


def available(root: Path | str = CPU_ROOT) -> str | None:
    """None if CPU groups can be made under root, else why not (with the fix)."""
    root = Path(root)
    if not root.is_dir():
        return (f"{root} does not exist: the cgroup v1 cpu controller is not mounted there "
                f"(mount it with `mount -t cgroup -o cpu cgroup {root}` as root, or run "
                f"without --cpu-share)")
    missing = [name for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cgroup.procs")
               if not (root / name).exists()]
    if missing:
        return (f"{root} is not a cgroup v1 cpu hierarchy (no {', '.join(missing)}); "
                f"a cgroup v2-only machine is not supported: run without --cpu-share")
    probe = root / f"pxcpu-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        return (f"cannot create a group under {root}: {err.strerror} (needs root, and a "
                f"writable cgroup mount; run without --cpu-share otherwise)")
    return None


def parse_share(text: str) -> float | None:
    """A --cpu-share value: cores per process (e.g. "0.25"), or off/shared/none (None)."""
    clean = text.strip().lower()
    if clean in SHARED:
        return None
    try:
        share = float(clean)
    except ValueError:
        share = float("nan")
    if not share >= MIN_SHARE:  # also refuses nan
        raise ConfigError(f"CPU share {text!r} must be a number of cores per process >= "
                          f"{MIN_SHARE} (e.g. 0.25), or one of {', '.join(SHARED)}")
    return share


def check_total(share: float, hosts: int, cores: int | None = None) -> None:
    """Refuse a share whose groups cannot all get it at once: hosts x share > cores."""
    if cores is None:
        cores = os.cpu_count() or 1
    total = share * hosts
    if total > cores + 1e-9:
        raise ConfigError(
            f"--cpu-share {share:g} for {hosts} hosts (CPU groups) is {total:g} cores, more "
            f"than this machine's {cores}: the groups could not all get their share at once, "
            f"so the runs would not be isolated. Use --cpu-share <= {cores / hosts:.3g}, "
            f"fewer --workers or --servers, or --placement colocated")


def network_key(network: str, share: float | None) -> str:
    """The results' network name: "1gbit" when cores are shared, "1gbit@0.25cpu" when not."""
    return network if share is None else f"{network}@{share:g}cpu"


def scaled_link(link: LinkSpec, share: float | None) -> LinkSpec:
    """The link of a host held to `share` cores: rate x share, latency / share (the host's
    work takes 1/share times longer; so does everything on its wire)."""
    if share is None:
        return link
    rate = None if link.rate_mbit is None else link.rate_mbit * share
    return LinkSpec(name=network_key(link.name, share), rate_mbit=rate,
                    latency_ms=link.latency_ms / share)


def _group_pids(path: Path) -> list[int]:
    try:
        text = (path / "cgroup.procs").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_group(path: Path, grace: float = KILL_GRACE_S) -> None:
    """SIGTERM every process in the group, SIGKILL what is left after `grace` seconds."""
    kill_all(lambda: _group_pids(path), grace)


def _remove_group(path: Path) -> bool:
    """Kill the group's processes and remove it; False if it was not there. A process that
    just exited can keep the group busy for a moment, hence the retries."""
    if not path.is_dir():
        return False
    _kill_group(path)
    for attempt in range(50):
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return False
        except OSError as err:
            if attempt == 49:
                raise CgroupError(f"cannot remove CPU group {path}: {err.strerror} "
                                  f"(processes left: {_group_pids(path)})") from err
            time.sleep(0.05)
    return False


def sweep(prefix: str = "pxb", root: Path | str = CPU_ROOT) -> list[str]:
    """Remove the groups `{root}/{prefix}-*` a killed run left, after killing their
    processes. Returns the paths removed, so a caller can report a previous crash."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [str(path) for path in sorted(root.glob(f"{prefix}-*"))
            if path.is_dir() and _remove_group(path)]


_LIVE: set[CpuGroups] = set()


@atexit.register
def _remove_all_live() -> None:
    """An interpreter exit (a failed harness, Ctrl-C, SIGTERM) must not leave groups."""
    for groups in list(_LIVE):
        groups.remove_all()


class CpuGroups:
    """The CPU groups of one benchmark: `{root}/{prefix}-{host}`, each held to `share` cores.
    A group is made by the first `exec_prefix(host)` or `create(host)`; `remove_all()`
    (or leaving the `with` block) kills what is left in them and removes them.

    The quota is a ceiling, not a guarantee: other load on the machine still competes.
    weight (cpu.shares; the kernel's default is 1024 per group and per ungrouped process)
    lets a group win that competition; the benchmark leaves it at the default."""

    def __init__(self, share: float, prefix: str = "pxb", root: Path | str = CPU_ROOT,
                 period_us: int = PERIOD_US, weight: int | None = None,
                 deferred: bool = False) -> None:
        if not share >= MIN_SHARE:
            raise ConfigError(f"CPU share {share!r} must be >= {MIN_SHARE} cores")
        if not 1000 <= period_us <= 1_000_000:
            raise ConfigError(f"CFS period {period_us} us must be in [1000, 1000000]")
        if not re.match(r"^[a-z][a-z0-9]*$", prefix):
            raise ConfigError(f"prefix {prefix!r} must be lowercase letters and digits")
        if weight is not None and not 2 <= weight <= 262144:
            raise ConfigError(f"cpu.shares weight {weight} must be in [2, 262144]")
        self.share, self.prefix, self.root = share, prefix, Path(root)
        self.period_us, self.weight = period_us, weight
        self.quota_us = max(1000, round(share * period_us))
        self.deferred = deferred  # groups start unlimited until throttle(), each run
        self.throttled = not deferred
        self._made: list[str] = []

    def __enter__(self) -> CpuGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove_all()

    def path(self, host: str) -> Path:
        if not _NAME_RE.match(host):
            raise ConfigError(f"host name {host!r} may only use letters, digits, '_', '.', '-'")
        return self.root / f"{self.prefix}-{host}"

    def create(self, host: str) -> Path:
        """The host's group, made (with its quota) if it is not there yet."""
        path = self.path(host)
        if host in self._made and path.is_dir():
            return path
        reason = available(self.root) if not self._made else None
        if reason:
            raise CgroupError(f"cannot isolate CPU: {reason}")
        _LIVE.add(self)
        try:
            path.mkdir(exist_ok=True)
            (path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (path / "cpu.cfs_quota_us").write_text(
                str(self.quota_us if self.throttled else UNLIMITED))
            if self.weight is not None:
                (path / "cpu.shares").write_text(str(self.weight))
        except OSError as err:
            raise CgroupError(f"cannot set up CPU group {path}: {err.strerror}") from err
        finally:
            if host not in self._made:
                self._made.append(host)
        return path

    def throttle(self) -> None:
        """Hold every group made so far, and every later one, to its quota (deferred groups
        start unlimited: a run's start-up is not what the benchmark measures)."""
        self.throttled = True
        for host in self._made:
            path = self.path(host)
            try:
                (path / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            except OSError as err:
                raise CgroupError(f"cannot set the quota of CPU group {path}: "
                                  f"{err.strerror}") from err

    def exec_prefix(self, host: str) -> list[str]:
        """Put this in front of a command (before `ip netns exec`) to run it in the group."""
        return ["sh", "-c", _JOIN, "sh", str(self.create(host))]

    def add(self, host: str, pid: int) -> None:
        """Move a running process (not its existing threads' children) into the group."""
        path = self.create(host)
        try:
            (path / "cgroup.procs").write_text(str(pid))
        except OSError as err:
            raise CgroupError(f"cannot move pid {pid} into {path}: {err.strerror}") from err

    def pids(self, host: str) -> list[int]:
        return _group_pids(self.path(host))

    def remove_all(self) -> None:
        """Kill what is left in every group made, and remove the groups (deferred groups of
        the next run start unlimited again). Idempotent."""
        try:
            for host in list(self._made):
                _remove_group(self.path(host))
                self._made.remove(host)
        finally:
            if not self._made:
                _LIVE.discard(self)
                self.throttled = not self.deferred  # (a group left keeps its quota)
