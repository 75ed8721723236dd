"""The CPU quota of a process's cgroups (parallax.runtime.cpu_quota), read from directory
trees laid out as the kernel's cgroup v1 and v2 filesystems are, with their files' formats;
tests/parallel/test_cpu_quota_process.py runs the strategy in a real cgroup."""
from __future__ import annotations

from pathlib import Path

import pytest

from parallax.runtime import cpu_quota
from parallax.runtime.cpu_quota import pool_threads, quota_cores


def _group(root: Path, path: str, **files: str) -> None:
    directory = root / path
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text + "\n")


def _proc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cgroup"
    path.write_text(text)
    return path


def test_v2_reads_cpu_max_from_the_group_up_and_takes_the_smallest(tmp_path):
    fs = tmp_path / "fs"
    _group(fs, "", cpu__max="max 100000")
    _group(fs, "kubepods/pod1", cpu__max="150000 100000")          # the pod: 1.5 cores
    _group(fs, "kubepods/pod1/ctr", cpu__max="max 100000")         # its container: none
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert quota_cores(proc, fs) == 1.5
    _group(fs, "kubepods/pod1/ctr", cpu__max="50000 100000")
    assert quota_cores(proc, fs) == 0.5


def test_v2_inside_a_cgroup_namespace_reads_the_mount_root(tmp_path):
    """containerd on cgroup v2: the container's own group is the mount's root, named `/`."""
    fs = tmp_path / "fs"
    _group(fs, "", cpu__max="200000 100000")
    assert quota_cores(_proc(tmp_path, "0::/\n"), fs) == 2.0


def test_v2_without_a_quota_anywhere_is_none(tmp_path):
    fs = tmp_path / "fs"
    _group(fs, "user.slice", cpu__max="max 100000")
    assert quota_cores(_proc(tmp_path, "0::/user.slice\n"), fs) is None
    assert quota_cores(tmp_path / "missing", fs) is None  # no /proc/self/cgroup


def test_v1_reads_the_cfs_quota_of_the_cpu_hierarchy(tmp_path):
    fs = tmp_path / "fs"
    _group(fs, "cpu,cpuacct", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    _group(fs, "cpu,cpuacct/docker/abc", cpu__cfs_quota_us="25000", cpu__cfs_period_us="100000")
    proc = _proc(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    assert quota_cores(proc, fs) == 0.25


def test_a_container_without_a_cgroup_namespace_reads_its_mount_root(tmp_path):
    """/proc/self/cgroup names the host's path, which the container's mount does not have:
    the mount's root is the container's own group."""
    fs = tmp_path / "fs"
    _group(fs, "cpu", cpu__cfs_quota_us="200000", cpu__cfs_period_us="100000")
    assert quota_cores(_proc(tmp_path, "3:cpu:/kubepods/besteffort/pod9/xyz\n"), fs) == 2.0


def test_unreadable_or_strange_files_give_no_quota(tmp_path):
    fs = tmp_path / "fs"
    _group(fs, "g", cpu__max="lots 100000")
    _group(fs, "cpu/g", cpu__cfs_quota_us="", cpu__cfs_period_us="0")
    proc = _proc(tmp_path, "garbage\n0::/g\n2:cpu:/g\n")
    assert quota_cores(proc, fs) is None


@pytest.mark.parametrize("quota, visible, threads", [
    (None, 8, None), (0.125, 2, (2, 1)), (0.5, 2, (2, 1)), (1.0, 2, (2, 1)), (1.5, 8, (2, 2)),
    (2.0, 2, None), (4.0, 2, None), (3.0000001, 32, (4, 4)), (6.0, 8, (6, 6))])
def test_pools_get_ceil_quota_threads_where_that_is_fewer_than_the_cores(quota, visible,
                                                                         threads):
    assert pool_threads(quota, visible) == threads


def test_the_environment_chooses_before_the_quota():
    class NoTensorFlow:  # size_tf_pools must not touch TensorFlow when told not to
        def __getattr__(self, name):
            raise AssertionError(f"touched tf.{name}")

    for name in cpu_quota.TF_THREAD_ENVS:
        assert cpu_quota.size_tf_pools(NoTensorFlow(), {name: "0"}, quota=0.5) is None
    assert cpu_quota.size_tf_pools(NoTensorFlow(), {}, quota=64.0) is None  # above the cores
