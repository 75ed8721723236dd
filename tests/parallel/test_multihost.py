"""`parallax run --hosts` across two "hosts": network namespaces joined by a veth pair, each with
its own sshd (scripts/netns_cluster.sh). The launcher runs in the first namespace; the second
namespace's server is started over ssh. Needs root and `ip netns`; sshd comes from
scripts/setup_env.sh (openssh-server)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from launching import PROBE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "netns_cluster.sh"
PARALLAX = str(Path(sys.executable).parent / "parallax")
PREFIX = "pxt"
NS = {"10.77.0.1": f"{PREFIX}a", "10.77.0.2": f"{PREFIX}b"}


def _netns_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"pxprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def cluster(tmp_path):
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    assert shutil.which("sshd") or Path("/usr/sbin/sshd").exists(), \
        "sshd is missing: run scripts/setup_env.sh as root (installs openssh-server)"
    env = {**os.environ, "NETNS_PREFIX": PREFIX}
    up = subprocess.run([str(SCRIPT), "up", str(tmp_path / "nc")], capture_output=True,
                        text=True, env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield tmp_path / "nc"
    finally:
        down = subprocess.run([str(SCRIPT), "down", str(tmp_path / "nc")], capture_output=True,
                              text=True, env=env)
        assert down.returncode == 0, down.stderr
        assert not set(NS.values()) & _namespaces(), "namespaces left behind"


def _servers() -> dict[int, tuple[str, str]]:
    """pid -> (address, namespace) of every running parallax_ps bound to a 10.77.0.x address."""
    found = {}
    for pid, cmd in _cmdlines():
        if b"parallax_ps" in cmd and b"--host" in cmd and cmd[cmd.index(b"--host") + 1] \
                .startswith(b"10.77.0.") and b"parallax.launch.hosts" not in cmd:
            ns = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                                text=True).stdout.strip()
            found[pid] = (cmd[cmd.index(b"--host") + 1].decode(), ns)
    return found


def _cmdlines() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, command line split at its NULs) of every process still there to be read."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            yield int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended while we looked
            continue


def _probe_processes() -> list[int]:
    """pids of launch_probe.py workers still running (in any namespace)."""
    return [pid for pid, cmd in _cmdlines()
            if PROBE.encode() in cmd and b"parallax.launch.hosts" not in cmd]


def _probe_wrappers() -> list[int]:
    """pids of `parallax.launch.hosts serve` wrappers running launch_probe.py."""
    return [pid for pid, cmd in _cmdlines()
            if PROBE.encode() in cmd and b"parallax.launch.hosts" in cmd and b"serve" in cmd]


def _launch(nc: Path, hosts: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{nc / 'bin'}:{os.environ['PATH']}",
           "TF_CPP_MIN_LOG_LEVEL": "2", "MULTIHOST_MARK": uuid.uuid4().hex, **(env or {})}
    return subprocess.Popen(["ip", "netns", "exec", NS["10.77.0.1"], PARALLAX, "run",
                             "--hosts", str(hosts), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _probes(output: str) -> list[dict]:
    return [json.loads(line[line.index("{"):]) for line in output.splitlines()
            if '{"probe"' in line]


def _write_hosts(path: Path) -> Path:
    path.write_text("server_port: 7000\nnetwork_interface: eth0\nhosts:\n"
                    "  - {host: 10.77.0.1, slots: 1, servers: 1}\n"
                    "  - {host: 10.77.0.2, slots: 1, servers: 1}\n")
    return path


@pytest.mark.multiprocess
def test_servers_on_two_hosts_one_worker(cluster, tmp_path):
    """A server in each namespace (the second over ssh); one worker (-np 1) sees both."""
    hosts = _write_hosts(tmp_path / "two.yaml")
    launcher = _launch(cluster, hosts, "-np", "1", "--", "python", PROBE, "--sleep", "4")
    deadline, seen = time.monotonic() + 60, {}
    while launcher.poll() is None and time.monotonic() < deadline:
        current = _servers()
        # a server seen while it exits has no namespace left to identify ('' as for the
        # root namespace): keep the last sample in which both were identified
        if len(current) == 2 and all(ns for _, ns in current.values()):
            seen = current
        time.sleep(0.3)
    output = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 0, output
    [probe] = _probes(output)
    assert probe["addresses"] == ["10.77.0.1:7000", "10.77.0.2:7000"], output
    assert sorted(seen.values()) == [("10.77.0.1", NS["10.77.0.1"]),
                                     ("10.77.0.2", NS["10.77.0.2"])], (seen, output)
    time.sleep(1)
    assert not _servers(), "servers left behind"
    for pid in seen:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"


@pytest.mark.multiprocess
def test_two_hosts_two_workers(cluster, tmp_path):
    hosts = _write_hosts(tmp_path / "two.yaml")
    launcher = _launch(cluster, hosts, "--", "python", PROBE)
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 0, output
    probes = _probes(output)
    assert sorted(p["rank"] for p in probes) == [0, 1], output
    for probe in probes:
        assert probe["addresses"] == ["10.77.0.1:7000", "10.77.0.2:7000"]
    assert probes[0]["netns"] != probes[1]["netns"], "both workers ran in one namespace"
    time.sleep(1)
    assert not _servers(), "servers left behind"


@pytest.mark.multiprocess
def test_two_hosts_two_workers_over_tensorflows_collectives(cluster, tmp_path):
    """--collectives tensorflow: the supervisor starts the second host's worker over ssh, and
    the two workers sum over TensorFlow's collectives across the namespaces."""
    hosts = _write_hosts(tmp_path / "two.yaml")
    launcher = _launch(cluster, hosts, "--collectives", "tensorflow", "--", "python", PROBE,
                       "--collective")
    output = launcher.communicate(timeout=180)[0]
    assert launcher.returncode == 0, output
    probes = sorted(_probes(output), key=lambda p: p["rank"])
    assert [(p["rank"], p["size"], p["sum"]) for p in probes] == [(0, 2, 3.0), (1, 2, 3.0)], \
        output
    assert probes[0]["netns"] != probes[1]["netns"], "both workers ran in one namespace"
    assert probes[0]["run_id"] == probes[1]["run_id"]
    time.sleep(1)
    assert not _servers(), "servers left behind"


@pytest.mark.multiprocess
def test_localhost_beside_another_host_over_tensorflows_collectives(cluster, tmp_path):
    """A host file naming this machine "localhost" next to another host: the local worker
    is announced by its address toward that host, not loopback (the remote worker could not
    reach it, and the job hung)."""
    hosts = tmp_path / "mixed.yaml"
    hosts.write_text("server_port: 7000\nnetwork_interface: eth0\nhosts:\n"
                     "  - {host: localhost, slots: 1, servers: 0}\n"
                     "  - {host: 10.77.0.2, slots: 1, servers: 1}\n")
    launcher = _launch(cluster, hosts, "--collectives", "tensorflow", "--", "python", PROBE,
                       "--collective")
    try:
        output = launcher.communicate(timeout=120)[0]
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output
    probes = sorted(_probes(output), key=lambda p: p["rank"])
    assert [(p["rank"], p["sum"]) for p in probes] == [(0, 3.0), (1, 3.0)], output


@pytest.mark.multiprocess
def test_a_remote_worker_ends_with_its_serve_wrapper(cluster, tmp_path):
    """The wrapper that runs the worker on the other host is killed -9: the worker ends too
    (it was left running, re-parented to init, while the job went on without it)."""
    hosts = _write_hosts(tmp_path / "two.yaml")
    launcher = _launch(cluster, hosts, "--collectives", "tensorflow", "--", "python", PROBE,
                       "--sleep", "90")
    try:
        deadline, wrapper = time.monotonic() + 60, None
        while wrapper is None and time.monotonic() < deadline:
            wrapper = next(iter(_probe_wrappers()), None)
            time.sleep(0.3)
        assert wrapper is not None, "no serve wrapper of a remote worker found"
        os.kill(wrapper, signal.SIGKILL)
        output = launcher.communicate(timeout=60)[0]
    finally:
        launcher.kill()
    assert launcher.returncode != 0, output
    time.sleep(1)
    assert not _probe_processes(), "a worker outlived its wrapper"


@pytest.mark.multiprocess
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_worker_ends_the_tensorflow_job_on_both_hosts(cluster, tmp_path, failing):
    """One worker exits 3 (rank 1 runs over ssh): the job fails naming it, and the other,
    which would sleep a minute, is stopped (nothing left in either namespace)."""
    hosts = _write_hosts(tmp_path / "two.yaml")
    started = time.monotonic()
    launcher = _launch(cluster, hosts, "--collectives", "tensorflow", "--", "python", PROBE,
                       "--sleep", "60", "--exit", "3", "--exit-rank", str(failing))
    output = launcher.communicate(timeout=180)[0]
    assert launcher.returncode == 3, output
    assert f"worker rank {failing} exited with code 3" in output, output
    assert time.monotonic() - started < 60, output
    time.sleep(1)
    assert not _servers(), "servers left behind"
    assert not [p for p in _probe_processes()], "a worker was left behind"


@pytest.mark.multiprocess
def test_secure_job_on_two_hosts(cluster, tmp_path):
    """--secure with --hosts: certificates for every host, copied over ssh to the other
    host; the server started there runs TLS + token, and both workers use them."""
    hosts = _write_hosts(tmp_path / "two.yaml")
    launcher = _launch(cluster, hosts, "--secure", "--", "python", PROBE)
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 0, output
    probes = _probes(output)
    assert sorted(p["rank"] for p in probes) == [0, 1], output
    assert not list(Path(tempfile.gettempdir()).glob("parallax-credentials-*")), \
        "credentials left behind"
    time.sleep(1)
    assert not _servers(), "servers left behind"


def _warm_processes() -> list[int]:
    """pids of warm processes (`parallax.launch.warm_fork`, retitled) still running."""
    return [pid for pid, cmd in _cmdlines() if cmd[0] == b"parallax-warm-process"]


def _namespace(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                          text=True).stdout.strip()


def _read_lines(launcher: subprocess.Popen) -> list[str]:
    """The launcher's output lines, appended as they come (a reader thread)."""
    import threading
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True).start()
    return lines


@pytest.mark.multiprocess
def test_remote_workers_start_warm_on_every_attempt(cluster, tmp_path):
    """--max-restarts: the other host gets a warm process too (over ssh, under the `serve`
    wrapper); its worker, killed -9, comes back forked warm again, as does this host's, and
    the job ends 0 with no warm process left on either host."""
    hosts = _write_hosts(tmp_path / "two.yaml")
    launcher = _launch(cluster, hosts, "--max-restarts", "1", "--data-dir",
                       str(tmp_path / "data"), "--", "python", PROBE, "--sleep", "60",
                       "--until-restart", "1")
    try:
        lines, deadline = _read_lines(launcher), time.monotonic() + 90
        while len(_probes("".join(lines))) < 2 and launcher.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        first = _probes("".join(lines))
        remote = [p for p in first if _namespace(p["pid"]) == NS["10.77.0.2"]]
        assert len(first) == 2 and len(remote) == 1, "".join(lines)
        os.kill(remote[0]["pid"], signal.SIGKILL)
        launcher.wait(120)
        time.sleep(0.5)  # (the reader's last lines)
        output = "".join(lines)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output
    probes = _probes(output)
    assert sorted({(p["restart"], p["rank"]) for p in probes}) == \
        [(0, 0), (0, 1), (1, 0), (1, 1)], output
    assert all(p["warm"] for p in probes), output
    assert "start cold" not in output, output
    time.sleep(1)
    assert not _warm_processes(), "a warm process was left behind"
    assert not _servers(), "servers left behind"


@pytest.mark.multiprocess
def test_a_socket_directory_other_users_can_change_sends_the_workers_cold(cluster, tmp_path):
    """TMPDIR (where the warm processes' directory is made, the same path on every host) is
    another user's, writable by all: the workers of both attempts start cold, the reason
    named once, and the job ends 0. The other host's warm process refuses such a directory
    alike (exit 3, the reason on stderr)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    os.chown(shared, 65534, 65534)
    hosts = _write_hosts(tmp_path / "two.yaml")
    env = {"TMPDIR": str(shared)}
    launcher = _launch(cluster, hosts, "--max-restarts", "1", "--data-dir",
                       str(tmp_path / "data"), "--", "python", PROBE, "--exit", "3",
                       "--exit-rank", "1", "--until-restart", "1", env=env)
    try:
        output = launcher.communicate(timeout=180)[0]
    finally:
        launcher.kill()
    assert launcher.returncode == 0, output
    probes = _probes(output)
    assert len({(p["restart"], p["rank"]) for p in probes}) == 4, output
    assert not any(p["warm"] for p in probes), output
    assert output.count("warm starts: the workers start cold") == 1, output
    assert f"{shared}, the parent of" in output and "can be changed by other users" in output
    refused = subprocess.run(
        ["ip", "netns", "exec", NS["10.77.0.2"], sys.executable, "-m",
         "parallax.launch.warm_fork", str(shared / "parallax-warm-x" / "fork.sock"), "-"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert refused.returncode == 3, refused.stderr
    assert "can be changed by other users" in refused.stderr
    assert not _warm_processes(), "a warm process was left behind"


@pytest.mark.multiprocess
def test_a_killed_launcher_leaves_no_warm_process_on_either_host(cluster, tmp_path):
    """kill -9 of `parallax run` while warm workers run on both hosts: the other host's warm
    process ends with its ssh connection (the `serve` wrapper there), this host's with its
    lifeline, and every worker with its warm process."""
    hosts = _write_hosts(tmp_path / "two.yaml")
    launcher = _launch(cluster, hosts, "--warm-starts", "on", "--", "python", PROBE,
                       "--sleep", "60")
    try:
        lines, deadline = _read_lines(launcher), time.monotonic() + 90
        while len(_probes("".join(lines))) < 2 and launcher.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        probes = _probes("".join(lines))
        assert all(p["warm"] for p in probes) and len(probes) == 2, "".join(lines)
        assert {_namespace(pid) for pid in _warm_processes()} == set(NS.values())
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while (_warm_processes() or _probe_processes()) and time.monotonic() < deadline:
            time.sleep(0.3)
    finally:
        launcher.kill()
    assert not _warm_processes(), "a warm process outlived the launcher"
    assert not _probe_processes(), "a worker outlived the launcher"


@pytest.mark.multiprocess
def test_a_host_ssh_cannot_reach_gets_no_warm_process_and_says_why(tmp_path):
    """ssh fails (no such host): the launcher's wait ends with ssh, and the reason names its
    exit and what it said (the workers then start cold: `WarmProcess.ensure_hosts`)."""
    from parallax.launch.hosts import HostSpec
    from parallax.launch.warm import STUB
    from parallax.launch.warm_remote import RemoteWarm
    remote = RemoteWarm(HostSpec("no-such-host.invalid"), str(tmp_path / "w" / "fork.sock"),
                        {}, 16)
    try:
        why = remote.refusal(str(STUB), gpus_ok=True, timeout=60)
    finally:
        remote.close()
        remote.wait(5)
    assert why.startswith("its warm process did not start (ssh exit 255: ") and \
        "no-such-host.invalid" in why, why
