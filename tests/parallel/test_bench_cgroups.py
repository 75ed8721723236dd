"""CPU isolation for the benchmark (parallax.bench.cgroups), with real cgroup v1 CPU groups
and real processes. Needs root and a cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu (CI runs
as root): without them these tests fail with the reason, they do not skip. Every test uses
its own prefix and checks that no group with it is left behind."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.bench import cgroups
from parallax.bench.cgroups import CgroupError, CpuGroups, available, sweep
from parallax.bench.netns import LinkSpec
from parallax.bench.sampler import ResourceSampler
from parallax.errors import ConfigError

PY = sys.executable
ROOT = cgroups.CPU_ROOT

# Spins for `argv[1]` seconds of wall time, then prints "done".
BURN = r"""
import sys, time
end = time.time() + float(sys.argv[1])
while time.time() < end: pass
print("done", flush=True)
"""


@pytest.fixture(scope="module", autouse=True)
def _needs_cgroups():
    reason = available()
    assert reason is None, f"CPU groups cannot be made here: {reason}"


@pytest.fixture
def prefix():
    name = "pxc" + secrets.token_hex(2)
    yield name
    left = _groups(name)
    sweep(name)
    assert not left, f"left behind: {left}"


def _groups(prefix: str) -> list[str]:
    return sorted(str(p) for p in ROOT.glob(f"{prefix}-*"))


def _cpu_rate(sampler: ResourceSampler, host: str, t0: float, t1: float) -> float:
    return sampler.between(t0, t1).cpu_by_host[host] / (t1 - t0)


def test_a_quarter_core_group_holds_a_burner_to_a_quarter(prefix):
    """Two burners spin for 2 s side by side, one in a 0.25-core group, one unconfined (a
    group whose quota is the whole machine); the sampler (/proc, per host) sees the first at
    <= 0.35 cores, the other at more. Both groups weigh 100 times an ordinary process, so
    other load on the machine (the CPU is shared with other work) cannot starve either."""
    cores = float(os.cpu_count() or 1)
    with CpuGroups(0.25, prefix, weight=102400) as groups, \
            CpuGroups(cores, prefix, weight=102400) as unconfined:
        group = groups.create("a")
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "25000"
        assert (group / "cpu.cfs_period_us").read_text().strip() == "100000"
        assert (group / "cpu.shares").read_text().strip() == "102400"
        procs = {}
        with ResourceSampler(None, lambda: [p.pid for p in procs.values()], interval=0.1,
                             labels=lambda: {p.pid: h for h, p in procs.items()}) as sampler:
            t0 = time.time()
            procs["a"] = subprocess.Popen(groups.exec_prefix("a") + [PY, "-c", BURN, "2"],
                                          stdout=subprocess.PIPE, text=True)
            procs["free"] = subprocess.Popen(unconfined.exec_prefix("free")
                                             + [PY, "-c", BURN, "2"],
                                             stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            assert groups.pids("a") == [procs["a"].pid]  # the shell became the command
            outputs = {h: p.communicate(timeout=30)[0] for h, p in procs.items()}
            t1 = time.time()
            time.sleep(0.3)
        assert {h: p.returncode for h, p in procs.items()} == {"a": 0, "free": 0}
        assert outputs == {"a": "done\n", "free": "done\n"}
        confined, free = (_cpu_rate(sampler, h, t0, t1) for h in ("a", "free"))
        print(f"cores used: confined {confined:.3f}, unconfined {free:.3f}")
        assert 0.15 <= confined <= 0.35, (confined, free)
        assert free > confined + 0.3, (confined, free)
    assert _groups(prefix) == []


def test_groups_are_removed_and_their_processes_killed_after_an_exception(prefix):
    with pytest.raises(RuntimeError, match="boom"):
        with CpuGroups(0.5, prefix) as groups:
            sleeper = subprocess.Popen(groups.exec_prefix("w0") + ["sleep", "1000"])
            stubborn = subprocess.Popen(groups.exec_prefix("w1") + [PY, "-c", (
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                " print('armed', flush=True); time.sleep(1000)")], stdout=subprocess.PIPE)
            assert stubborn.stdout.readline().strip() == b"armed"
            assert _groups(prefix) == [f"{ROOT}/{prefix}-w0", f"{ROOT}/{prefix}-w1"]
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) == -15
    assert stubborn.wait(timeout=10) == -9
    assert _groups(prefix) == []


def test_add_moves_a_running_process(prefix):
    sleeper = subprocess.Popen(["sleep", "1000"])
    try:
        with CpuGroups(0.3, prefix) as groups:
            groups.add("s", sleeper.pid)
            assert groups.pids("s") == [sleeper.pid]
    finally:
        sleeper.kill()
    assert sleeper.wait(timeout=10) == -15  # remove_all terminated it first
    assert _groups(prefix) == []


def test_sweep_removes_the_groups_of_a_killed_run(prefix):
    """A harness killed with SIGKILL (no clean-up at all) leaves a group with a process in
    it; sweep kills the process and removes the group, and only groups of its prefix."""
    other = ROOT / f"{prefix}x-w0"  # another prefix that merely starts with this one
    other.mkdir()
    sleeper = subprocess.Popen(["sleep", "1000"])
    harness = subprocess.Popen([PY, "-c", (
        "import os, signal, sys; from parallax.bench.cgroups import CpuGroups;"
        f"CpuGroups(0.25, '{prefix}').add('w0', {sleeper.pid}); print('in', flush=True);"
        "os.kill(os.getpid(), signal.SIGKILL)")], stdout=subprocess.PIPE, text=True)
    try:
        assert harness.stdout.readline().strip() == "in"
        assert harness.wait(timeout=30) == -9
        assert _groups(prefix) == [f"{ROOT}/{prefix}-w0"]
        assert sweep(prefix) == [f"{ROOT}/{prefix}-w0"]
        assert sleeper.wait(timeout=10) == -15
        assert _groups(prefix) == [] and other.is_dir()
        assert sweep(prefix) == []
    finally:
        sleeper.kill()
        other.rmdir()


def test_interpreter_exit_removes_the_groups(prefix):
    done = subprocess.run([PY, "-c", (
        "from parallax.bench.cgroups import CpuGroups;"
        f"g = CpuGroups(0.25, '{prefix}'); g.create('a'); g.create('b');"
        f"import pathlib; assert len(list(pathlib.Path('{ROOT}').glob('{prefix}-*'))) == 2")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _groups(prefix) == []


def test_missing_cgroup_v1_cpu_is_refused_with_the_reason(tmp_path, prefix):
    missing = tmp_path / "no-such-root"
    reason = available(missing)
    assert str(missing) in reason and "not mounted" in reason and "--cpu-share" in reason
    with pytest.raises(CgroupError, match="not mounted"):
        CpuGroups(0.25, prefix, root=missing).exec_prefix("a")
    plain = tmp_path / "plain"  # a directory, but not a cgroup hierarchy
    plain.mkdir()
    assert "not a cgroup v1 cpu hierarchy" in available(plain)
    assert sweep(prefix, missing) == []


def test_bench_refuses_isolation_without_cgroups_from_the_command_line(tmp_path, capsys):
    from parallax.bench.command import main
    code = main(["--cpu-share", "0.25", "--cgroup-root", str(tmp_path / "none"),
                 "--networks", "loopback", "--size", "short", "--workloads", "dense",
                 "--systems", "horovod", "--workers", "1", "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--cpu-share needs cgroup v1 CPU groups" in err and str(tmp_path / "none") in err


def test_the_option_reaches_the_harness():
    from parallax.bench.command import config_from, parser
    config = config_from(parser().parse_args(["--cpu-share", "off,0.25", "--cgroup-root",
                                              "/x", "--workers", "1,2",
                                              "--cpu-period-us", "20000"]))
    assert (config.cpu_shares, config.cgroup_root, config.cpu_period_us) == (
        (None, 0.25), "/x", 20000)
    with pytest.raises(ConfigError, match="--cpu-period-us 50 must be in"):
        config_from(parser().parse_args(["--cpu-period-us", "50"]))
    assert config_from(parser().parse_args([])).cpu_shares == (None,)
    for bad in ("0", "-1", "lots", "0.001"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--cpu-share", bad])


def test_too_many_cores_in_total_are_refused_with_the_numbers():
    from parallax.bench.harness import BenchConfig
    with pytest.raises(ConfigError) as err:
        cgroups.check_total(0.5, 7, cores=2)
    assert "0.5 for 7 hosts (CPU groups) is 3.5 cores, more than this machine's 2" \
        in str(err.value)
    assert "--cpu-share <= 0.286" in str(err.value)
    cgroups.check_total(0.25, 7, cores=2)  # 1.75 cores: fine
    cores = os.cpu_count() or 1
    with pytest.raises(ConfigError, match="for 7 hosts"):  # 4 + 2 servers + chief
        BenchConfig(workers=(1, 4), servers=2, cpu_shares=(None, float(cores)),
                    placements=("colocated", "dedicated"))
    with pytest.raises(ConfigError, match="for 4 hosts"):  # servers inside worker hosts
        BenchConfig(workers=(1, 4), servers=2, cpu_shares=(None, float(cores)))


def test_links_scale_with_the_share():
    link = cgroups.scaled_link(LinkSpec.parse("1gbit+0.1ms"), 0.25)
    assert (link.name, link.rate_mbit, link.latency_ms) == ("1gbit+0.1ms@0.25cpu", 250.0, 0.4)
    assert cgroups.scaled_link(LinkSpec.parse("1gbit"), None) == LinkSpec.parse("1gbit")
    assert cgroups.scaled_link(LinkSpec(), 0.5).rate_mbit is None
    assert cgroups.network_key("loopback", 0.5) == "loopback@0.5cpu"
    assert cgroups.parse_share("off") is None and cgroups.parse_share("0.25") == 0.25


def test_network_record_states_share_and_effective_rate(prefix):
    from parallax.bench.harness import _network_record
    from parallax.bench.netns import EmulatedCluster
    link = cgroups.scaled_link(LinkSpec.parse("1gbit"), 0.25)
    with EmulatedCluster(["a"], link, prefix=prefix) as cluster:
        record = _network_record("1gbit", cluster, CpuGroups(0.25, prefix))
    assert json.loads(json.dumps(record)) == {
        "name": "1gbit@0.25cpu", "rate_mbit": 250.0, "latency_ms": 0.0,
        "latency_emulated": False, "latency_note": "no latency requested", "cpu_share": 0.25,
        "cpu_period_us": 100000, "cpu_quota_us": 25000, "nominal_rate_mbit": 1000.0,
        "nominal_latency_ms": 0.0}
    assert _network_record("loopback", None)["name"] == "loopback"


def test_deferred_groups_start_unlimited_until_throttled(prefix):
    """A run's start-up is not measured: deferred groups start with no quota; throttle() holds
    every group made, and every later one, to the share; remove_all() starts the next run's
    groups unlimited again (read back from the kernel's files)."""
    def quota(host):
        return int((groups.path(host) / "cpu.cfs_quota_us").read_text())

    with CpuGroups(0.25, prefix, deferred=True) as groups:
        groups.create("w0")
        assert quota("w0") == cgroups.UNLIMITED
        groups.throttle()
        groups.create("w1")
        assert (quota("w0"), quota("w1")) == (25_000, 25_000)
        groups.remove_all()
        groups.create("w0")
        assert quota("w0") == cgroups.UNLIMITED
    with CpuGroups(0.25, prefix) as groups:  # not deferred: the quota from the start
        groups.create("w0")
        assert quota("w0") == 25_000
