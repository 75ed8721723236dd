"""The CPU quota of this process's cgroup, and TensorFlow thread pools sized to it.

TensorFlow sizes its inter-op and intra-op pools by the cores a process may be scheduled on
(`sched_getaffinity`), not by its cgroup's CPU quota: a Kubernetes container limited to
1 CPU on a 32-core node gets 32 + 32 threads, which spin and switch inside the quota the
container is throttled to. Measured here (hybrid ctr, one worker held to 0.5 core on 2 cores):
2 + 2 threads spent 19.3 ms of worker CPU and 105 context switches per step (55.8 ms a
step); 1 + 1 threads 13.5 ms and 8 (38.5 ms a step). So the strategy gives each pool
ceil(quota) threads where that is fewer than the visible cores, as Go's automaxprocs and
the JVM's container support do (at least MIN_INTER_OP inter-op threads), and says so on the
"parallax" logger. Setting TF_NUM_INTEROP_THREADS or TF_NUM_INTRAOP_THREADS (0: TensorFlow's
own default), or either pool with tf.config.threading before the strategy, leaves the pools
to you.

cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`) are read from the
process's group up through the ancestors it can see; the smallest quota found applies.
Inside a private cgroup namespace (containerd's default on cgroup v2: /proc/self/cgroup says
`0::/`) that is the container's own limit only; a limit set on the pod alone is not seen.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator, Mapping

from parallax.env import TF_THREAD_ENVS

CGROUP_FS = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_V1_MOUNTS = ("cpu,cpuacct", "cpuacct,cpu", "cpu")
# TensorFlow's distributed runtime can wait on an inter-op thread for another op: its
# ParameterServerStrategy deadlocked on one (the benchmark's chief, before its first step).
MIN_INTER_OP = 2


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ancestors(mount: Path, group: str) -> Iterator[Path]:
    """The group's directory under `mount` and each parent up to the mount, those that exist
    (a container without its own cgroup namespace sees only the mount: its own group)."""
    parts = [p for p in group.split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):
        directory = mount.joinpath(*parts[:depth])
        if directory.is_dir():
            yield directory


def _v2_quotas(fs: Path, group: str) -> list[float]:
    quotas = []
    for directory in _ancestors(fs, group):
        fields = (_read(directory / "cpu.max") or "max").split()
        if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
            quotas.append(int(fields[0]) / int(fields[1]))
    return quotas


def _v1_quotas(fs: Path, controllers: str, group: str) -> list[float]:
    mounts = [fs / name for name in (controllers, *_V1_MOUNTS) if (fs / name).is_dir()]
    if not mounts:
        return []
    quotas = []
    for directory in _ancestors(mounts[0], group):
        quota = _read(directory / "cpu.cfs_quota_us")
        period = _read(directory / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0 and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return quotas


def quota_cores(proc_cgroup: Path = PROC_CGROUP, fs: Path = CGROUP_FS) -> float | None:
    """The cores this process's cgroups let it use (the smallest quota from its group up),
    or None where none is set or none can be read."""
    text = _read(proc_cgroup)
    quotas: list[float] = []
    for line in (text or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, group = fields
        try:
            if hierarchy == "0" and controllers == "":
                quotas += _v2_quotas(fs, group)
            elif "cpu" in controllers.split(","):
                quotas += _v1_quotas(fs, controllers, group)
        except ValueError:  # a file this module does not understand: no quota from it
            continue
    return min(quotas, default=None)


def pool_threads(quota: float | None, visible: int) -> tuple[int, int] | None:
    """(inter-op, intra-op) threads under `quota` cores: ceil(quota) each, never fewer than
    MIN_INTER_OP inter-op threads (nor more than the visible cores); None where TensorFlow's
    own choice (one per visible core) is already no more than the quota allows."""
    if quota is None:
        return None
    intra = max(1, math.ceil(quota - 1e-9))
    if intra >= visible:
        return None
    return min(visible, max(MIN_INTER_OP, intra)), intra


def _visible_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def size_tf_pools(tf, environ: Mapping[str, str] = os.environ,
                  quota: float | None = None) -> tuple[bool, str] | None:
    """Give TensorFlow's pools `pool_threads` where the quota is below the visible cores and
    neither the environment nor the program (tf.config.threading) chose: (whether it could,
    what was done or why not), for the log, or None where nothing applies. `quota`: the
    cgroups' (read when None)."""
    if any(name in environ for name in TF_THREAD_ENVS):
        return None
    quota = quota_cores() if quota is None else quota
    visible = _visible_cores()
    threads = pool_threads(quota, visible)
    if threads is None or _chosen_in_program(tf):
        return None
    inter, intra = threads
    why = (f"this process's CPU quota is {quota:g} cores of the {visible} it may run on; "
           f"set {' or '.join(TF_THREAD_ENVS)} to choose (0: TensorFlow's default)")
    try:
        tf.config.threading.set_inter_op_parallelism_threads(inter)
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    except RuntimeError:  # TensorFlow's runtime started before the strategy was made
        return False, (f"TensorFlow's thread pools were made before the strategy, with one "
                       f"thread per visible core: {why}, or make the strategy before running "
                       f"any op")
    return True, (f"TensorFlow thread pools: {inter} inter-op and {intra} intra-op "
                  f"threads ({why})")


def _chosen_in_program(tf) -> bool:
    """Whether the program set a pool's size itself (tf.config.threading) already."""
    threading = tf.config.threading
    return bool(threading.get_inter_op_parallelism_threads() or
                threading.get_intra_op_parallelism_threads())
