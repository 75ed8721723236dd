"""The benchmark's emulated cluster (parallax.bench.netns) and resource sampler
(parallax.bench.sampler), with real namespaces, real tc and real sockets. Needs root and
iproute2 (CI runs as root): without them these tests fail with the reason, they do not skip.
Every test uses its own prefix and checks that nothing with it is left behind."""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.bench.netns import (EmulatedCluster, LinkSpec, NetnsError, available,
                                  subnet_for, sweep)
from parallax.bench.sampler import ResourceSampler, Sample, interpolate, window_usage
from parallax.errors import ConfigError, ParallaxError

PY = sys.executable
PAYLOAD = 20_000_000
PORT = 5001

# Receives until the sender closes, then prints how many bytes it got.
SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print(n, flush=True)
"""
# Sends argv[3] bytes to argv[1]:argv[2] (a host *name*: resolved through /etc/netns/NS/hosts).
CLIENT = r"""
import socket, sys
n = int(sys.argv[3]); c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = b"x" * (1 << 20)
while n > 0:
    k = min(n, len(buf)); c.sendall(buf[:k]); n -= k
c.close()
"""
# Burns ~1 s of CPU, then idles so the sampler sees its final value before it exits.
BURNER = r"""
import time
while time.process_time() < 1.0: pass
time.sleep(0.6)
"""


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces():
    reason = available()
    assert reason is None, f"the emulated cluster cannot run here: {reason}"


@pytest.fixture
def prefix():
    """A fresh prefix per test ("pxb" + 4 hex: interface names stay far below 15 chars);
    after the test nothing carrying it may remain."""
    name = "pxb" + secrets.token_hex(2)
    yield name
    left = _leftovers(name)
    sweep(name)
    assert not left, f"left behind: {left}"


def _leftovers(prefix: str) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True,
                                text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                           text=True).stdout
    found = [ns for ns in namespaces if ns.startswith(prefix)]
    found += [line.split(": ")[1] for line in links.splitlines() if f": {prefix}" in line]
    found += [str(p) for p in Path("/etc/netns").glob(f"{prefix}*")]
    return found


def _qdiscs(cluster: EmulatedCluster, host: str) -> tuple[str, str]:
    """(qdiscs on the host's eth0, qdiscs on its bridge-side veth)."""
    inside = subprocess.run(["tc", "-n", cluster.namespace(host), "qdisc", "show", "dev",
                             "eth0"], capture_output=True, text=True, check=True).stdout
    i = cluster.hosts.index(host)
    outside = subprocess.run(["tc", "qdisc", "show", "dev", f"{cluster.prefix}-v{i}"],
                             capture_output=True, text=True, check=True).stdout
    return inside, outside


def _transfer(cluster: EmulatedCluster, src: str, dst: str, nbytes: int = PAYLOAD) -> float:
    """Send nbytes from src to dst over TCP; returns the seconds the send took."""
    server = subprocess.Popen(cluster.exec_prefix(dst) + [PY, "-c", SERVER,
                              cluster.address(dst), str(PORT)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        start = time.monotonic()
        subprocess.run(cluster.exec_prefix(src) + [PY, "-c", CLIENT, dst, str(PORT),
                       str(nbytes)], check=True, timeout=60)
        received = server.stdout.readline().strip()
        elapsed = time.monotonic() - start
        assert server.wait(timeout=30) == 0
    finally:
        server.kill()
    assert int(received) == nbytes
    return elapsed


def _assert_counted(before: dict, after: dict, src: str, dst: str, nbytes: int) -> None:
    sent = after[src][0] - before[src][0]
    received = after[dst][1] - before[dst][1]
    for what, value in (("sent by " + src, sent), ("received by " + dst, received)):
        assert nbytes <= value <= nbytes * 1.1 + 100_000, (what, value, nbytes)


# --- LinkSpec ----------------------------------------------------------------------------
@pytest.mark.parametrize("text,rate,latency", [
    ("unlimited", None, 0.0), ("100mbit", 100.0, 0.0), ("1gbit", 1000.0, 0.0),
    ("10gbit", 10000.0, 0.0), ("1gbit+0.1ms", 1000.0, 0.1), ("2.5Gbit", 2500.0, 0.0),
    ("unlimited+2ms", None, 2.0)])
def test_linkspec_parse_accepts(text, rate, latency):
    spec = LinkSpec.parse(text)
    assert (spec.rate_mbit, spec.latency_ms) == (rate, latency)
    assert spec.name == text.lower()


@pytest.mark.parametrize("text", ["", "fast", "1gb", "0mbit", "-1gbit", "1gbit+", "1gbit+2",
                                  "1gbit+xms", "loopback", "100kbit", "1gbit+1ms+2ms"])
def test_linkspec_parse_rejects(text):
    with pytest.raises(ConfigError) as err:
        LinkSpec.parse(text)
    assert repr(text) in str(err.value) and "unlimited" in str(err.value)


def test_bad_cluster_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="interface names"):
        EmulatedCluster(["a"], LinkSpec(), prefix="averyverylongprefix")
    with pytest.raises(ConfigError, match="unique"):
        EmulatedCluster(["a", "a"], LinkSpec())
    with pytest.raises(ConfigError, match="host name"):
        EmulatedCluster(["a b"], LinkSpec())
    with pytest.raises(ConfigError, match="not in this cluster"):
        EmulatedCluster(["a"], LinkSpec()).address("b")


# --- the cluster -------------------------------------------------------------------------
def test_up_addresses_names_and_unshaped_transfer(prefix):
    """Addresses, name resolution via /etc/netns, the root namespace reachable at the
    gateway, an unshaped link (no tbf), and a 20 MB transfer counted on both ends."""
    with EmulatedCluster(["a", "b"], LinkSpec(), prefix=prefix, subnet="10.79.3") as cl:
        assert cl.gateway == "10.79.3.254"
        for host, addr in (("a", "10.79.3.1"), ("b", "10.79.3.2")):
            assert cl.address(host) == addr
            out = subprocess.run(["ip", "-n", f"{prefix}-{host}", "-j", "addr", "show", "dev",
                                  "eth0"], capture_output=True, text=True, check=True).stdout
            assert [a["local"] for a in json.loads(out)[0]["addr_info"]] == [addr]
            assert "tbf" not in "".join(_qdiscs(cl, host))
        resolved = subprocess.run(cl.exec_prefix("a") + [PY, "-c", (
            "import socket; print(socket.gethostbyname('b'), socket.gethostbyname('a'),"
            " socket.gethostbyname(socket.gethostname()))")],
            capture_output=True, text=True, check=True).stdout.split()
        assert resolved == ["10.79.3.2", "10.79.3.1", "10.79.3.1"]
        # A rendezvous server in the root namespace, listening on the gateway address.
        with __import__("socket").create_server((cl.gateway, 0)) as listener:
            port = listener.getsockname()[1]
            subprocess.run(cl.exec_prefix("b") + [PY, "-c", (
                f"import socket; socket.create_connection(('{cl.gateway}', {port}), 5)")],
                check=True, timeout=30)
        before = cl.counters()
        _transfer(cl, "a", "b")
        after = cl.counters()
        _assert_counted(before, after, "a", "b", PAYLOAD)
        # The cheap root-side counters equal what `ip -n NS -s link` reports inside.
        for host in ("a", "b"):
            assert cl.ns_counters(host) == cl.counters()[host]


def test_shaping_limits_the_rate_both_ways(prefix):
    with EmulatedCluster(["a", "b"], LinkSpec.parse("100mbit"), prefix=prefix) as cl:
        for host in ("a", "b"):
            inside, outside = _qdiscs(cl, host)
            assert "tbf" in inside and "rate 100Mbit" in inside, inside
            assert "tbf" in outside and "rate 100Mbit" in outside, outside
        before = cl.counters()
        elapsed = _transfer(cl, "a", "b")
        _assert_counted(before, cl.counters(), "a", "b", PAYLOAD)
        # A lower bound only: the sender's upload limit (and the receiver's download limit).
        assert elapsed >= 0.8 * PAYLOAD * 8 / 100e6, elapsed


def test_latency_is_emulated_or_the_reason_is_recorded(prefix):
    with EmulatedCluster(["a"], LinkSpec.parse("1gbit+1ms"), prefix=prefix) as cl:
        inside, _ = _qdiscs(cl, "a")
        assert "tbf" in inside
        if cl.latency_emulated:
            assert "netem" in inside and "delay 1ms" in inside, inside
        else:
            assert "netem" in cl.latency_note and "not emulated" in cl.latency_note


def test_down_kills_processes_and_removes_everything(prefix):
    cl = EmulatedCluster(["a", "b"], LinkSpec.parse("1gbit"), prefix=prefix).up()
    try:
        # One that exits on SIGTERM, one that ignores it (killed after the grace period).
        polite = subprocess.Popen(cl.exec_prefix("a") + ["sleep", "1000"])
        stubborn = subprocess.Popen(cl.exec_prefix("b") + [PY, "-c", (
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            " print('armed', flush=True); time.sleep(1000)")], stdout=subprocess.PIPE)
        assert stubborn.stdout.readline().strip() == b"armed"
        assert set(cl.pids()) == {polite.pid, stubborn.pid}
        assert _leftovers(prefix)
    finally:
        cl.down()
    assert polite.wait(timeout=10) == -15
    assert stubborn.wait(timeout=10) == -9
    assert _leftovers(prefix) == []
    cl.down()  # idempotent: everything is already gone


def test_exception_inside_with_still_cleans_up(prefix):
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(["a"], LinkSpec(), prefix=prefix):
            assert _leftovers(prefix)
            raise RuntimeError("boom")
    assert _leftovers(prefix) == []


def test_failed_up_cleans_what_it_made_and_names_the_command(prefix):
    """A link named like host 1's veth peer already exists: host 0 and the bridge are made,
    host 1 fails; up() must remove host 0 and the bridge and say which command failed."""
    blocker = f"{prefix}-p1"
    subprocess.run(["ip", "link", "add", blocker, "type", "bridge"], check=True)
    try:
        with pytest.raises(NetnsError) as err:
            EmulatedCluster(["a", "b"], LinkSpec(), prefix=prefix).up()
        assert isinstance(err.value, ParallaxError)
        assert "ip link add" in str(err.value) and "exists" in str(err.value), str(err.value)
        assert _leftovers(prefix) == [blocker]
    finally:
        subprocess.run(["ip", "link", "del", blocker], check=True)


def test_two_clusters_at_once_need_two_subnets(prefix):
    """Different prefixes get different subnets by default, so two benchmarks can run at
    once; a second cluster on a subnet in use is refused, naming the holder and the fix."""
    # Prefixes hash onto 250 subnets: a random fixture prefix and prefix + "y" collided one
    # run in 250 (a flaky failure); take the first suffix whose subnet differs.
    other = next(prefix + s for s in "yzwv" if subnet_for(prefix + s) != subnet_for(prefix))
    assert subnet_for("pxb") == "10.78.0" and subnet_for(prefix) != subnet_for(other)
    with EmulatedCluster(["a"], LinkSpec(), prefix=prefix) as first:
        with EmulatedCluster(["a"], LinkSpec(), prefix=other) as second:
            assert first.gateway != second.gateway
        clash = EmulatedCluster(["a"], LinkSpec(), prefix=other, subnet=first.subnet)
        with pytest.raises(NetnsError) as err:
            clash.up()
        assert f"{first.gateway} is already on {prefix}br" in str(err.value)
        assert "--prefix" in str(err.value)
    assert _leftovers(other) == []


def test_sweep_removes_a_crashed_runs_leftovers_only(prefix):
    other = f"{prefix}x"  # a different prefix that merely starts with this one: untouched
    made = [["ip", "netns", "add", f"{prefix}-w0"], ["ip", "netns", "add", f"{other}-w0"],
            ["ip", "link", "add", f"{prefix}br", "type", "bridge"],
            ["ip", "link", "add", f"{prefix}-v0", "type", "veth", "peer", "name",
             f"{prefix}-p0"]]
    for argv in made:
        subprocess.run(argv, check=True)
    Path(f"/etc/netns/{prefix}-w0").mkdir(parents=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{prefix}-w0", "sleep", "1000"])
    try:
        time.sleep(0.2)
        removed = sweep(prefix)
        assert sorted(removed) == sorted([f"{prefix}-w0", f"{prefix}br", f"{prefix}-v0",
                                          f"/etc/netns/{prefix}-w0"]), removed
        assert sleeper.wait(timeout=10) == -15
        assert _leftovers(prefix) == [f"{other}-w0"]
        assert sweep(prefix) == []
    finally:
        subprocess.run(["ip", "netns", "del", f"{other}-w0"], check=True)
        sleeper.kill()


def test_interpreter_exit_cleans_up(prefix):
    """A harness that exits without down() (the atexit hook) leaves nothing behind."""
    subprocess.run([PY, "-c", (
        "from parallax.bench.netns import EmulatedCluster, LinkSpec;"
        f"EmulatedCluster(['a'], LinkSpec.parse('1gbit'), prefix='{prefix}').up();"
        "import subprocess; assert subprocess.run(['ip', 'netns', 'list'],"
        f" capture_output=True, text=True).stdout.count('{prefix}-a') == 1")],
        check=True, timeout=60)
    assert _leftovers(prefix) == []


# --- the sampler -------------------------------------------------------------------------
SYNTHETIC = [Sample(0.0, 0.0, {"a": (0.0, 0.0)}), Sample(1.0, 1.0, {"a": (100.0, 10.0)}),
             Sample(2.0, 3.0, {"a": (300.0, 30.0)})]


def test_interpolation_with_synthetic_samples():
    assert interpolate(SYNTHETIC, 1.0) == SYNTHETIC[1]
    mid = interpolate(SYNTHETIC, 1.25)
    assert (mid.cpu_seconds, mid.bytes) == (1.5, {"a": (150.0, 15.0)})
    usage = window_usage(SYNTHETIC, 0.5, 1.5)
    assert (usage.seconds, usage.cpu_seconds, usage.bytes) == (1.0, 1.5, {"a": (150.0, 15.0)})
    whole = window_usage(SYNTHETIC, 0.0, 2.0)
    assert (whole.seconds, whole.cpu_seconds, whole.bytes) == (2.0, 3.0, {"a": (300.0, 30.0)})
    assert window_usage(SYNTHETIC, 0.3, 0.3).bytes == {"a": (0.0, 0.0)}


def test_cpu_per_host_is_interpolated_like_the_total():
    """A host first seen at a later sample had used nothing before it."""
    samples = [Sample(0.0, 0.0, {}, {"w0": 0.0}), Sample(1.0, 2.0, {}, {"w0": 1.0, "ps0": 1.0}),
               Sample(2.0, 4.0, {}, {"w0": 3.0, "ps0": 1.0})]
    assert interpolate(samples, 0.5).cpu_by_host == {"w0": 0.5, "ps0": 0.5}
    usage = window_usage(samples, 0.5, 2.0)
    assert usage.cpu_seconds == 3.0 and usage.cpu_by_host == {"ps0": 0.5, "w0": 2.5}
    assert window_usage(SYNTHETIC, 0.0, 1.0).cpu_by_host == {}  # unlabelled processes


@pytest.mark.parametrize("t0,t1,message", [(-0.1, 1.0, "outside the sampled range"),
                                           (1.0, 2.5, "outside the sampled range"),
                                           (1.5, 1.0, "before its start")])
def test_window_outside_samples_is_an_error(t0, t1, message):
    with pytest.raises(ConfigError, match=message):
        window_usage(SYNTHETIC, t0, t1)
    with pytest.raises(ConfigError, match="no samples"):
        window_usage([], 0.0, 0.0)


def test_sampler_charges_cpu_and_bytes_to_the_window(prefix):
    with EmulatedCluster(["a", "b"], LinkSpec(), prefix=prefix) as cl:
        with ResourceSampler(cl.counters, cl.pids, interval=0.1) as sampler:
            time.sleep(0.5)
            t0 = time.time()
            burner = subprocess.Popen(cl.exec_prefix("a") + [PY, "-c", BURNER])
            _transfer(cl, "b", "a")
            assert burner.wait(timeout=30) == 0
            t1 = time.time()
            time.sleep(0.3)
            # Nothing ran yet. (The window ends over one interval before t0: interpolation
            # smears a change over the interval it happened in.)
            before = sampler.between(t0 - 0.4, t0 - 0.15)
        usage = sampler.between(t0, t1)
        assert usage.seconds == pytest.approx(t1 - t0)
        # The burner's second plus whatever the transfer's processes were seen to use.
        assert 0.9 <= usage.cpu_seconds <= 3.0, usage
        assert PAYLOAD <= usage.bytes["b"][0] <= PAYLOAD * 1.1 + 100_000, usage
        assert PAYLOAD <= usage.bytes["a"][1] <= PAYLOAD * 1.1 + 100_000, usage
        # (CPU within 0.05 s of none: on a loaded machine a late sample smears the burner's
        # start back into the window: 0.013 s seen once in a full run)
        assert before.cpu_seconds <= 0.05 and before.bytes == {"a": (0, 0), "b": (0, 0)}, \
            before
        # The burner has exited by t1 + 0.25: its CPU seconds stay counted.
        later = sampler.between(t0, t1 + 0.25)
        assert later.cpu_seconds == pytest.approx(usage.cpu_seconds, abs=0.05), (usage, later)
        with pytest.raises(ConfigError, match="outside the sampled range"):
            sampler.between(t0, time.time() + 1)
