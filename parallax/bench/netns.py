"""An emulated cluster on one machine: one network namespace per benchmark process.

Why: the benchmarks compare how much each framework sends over the network and how fast it
trains when the network is the bottleneck. On one machine every process would otherwise talk
over loopback (no limit, no per-process byte counts). Here each "host" (a worker, a parameter
server, a coordinator) gets its own namespace `{prefix}-{host}` whose `eth0` is one end of a
veth pair; the other end sits on a Linux bridge `{prefix}br` in the root namespace, so every
host reaches every other at its own address and the root namespace (where a rendezvous server
may run) at the bridge address. Per host link:

* bandwidth: a `tbf` qdisc on both ends: egress of the namespace's `eth0` shapes what the host
  sends (upload); egress of the bridge-side veth shapes what it receives (download). A transfer
  between two hosts therefore passes the sender's upload and the receiver's download limit,
  like two NICs joined by a non-blocking switch.
* latency: `netem` where the kernel has it (one-way delay on what each host sends, so a round
  trip between two hosts grows by 2 * latency_ms). Many kernels (this project's CI included)
  lack it; then the cluster comes up without latency and says so in `latency_emulated` /
  `latency_note` instead of failing, so a report can print the caveat.
* bytes: the counters of each host's link (`counters()`).

Everything is made with `ip`/`tc` argument lists (never shell strings), and removed by
`down()`, by `__exit__`, at interpreter exit (atexit), and by `sweep(prefix)` for leftovers of
a crashed run. Needs root and iproute2; `available()` says why not when it cannot work.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from parallax.errors import ConfigError, ParallaxError

NETNS_ETC = Path("/etc/netns")
SYS_NET = Path("/sys/class/net")
IFNAME_MAX = 15  # IFNAMSIZ - 1: the kernel rejects longer interface names
KILL_GRACE_S = 2.0

_LINK_FORMS = ("unlimited", "<N>mbit", "<N>gbit", "<rate>+<M>ms (e.g. 1gbit+0.1ms)")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(mbit|gbit)$")
_LATENCY_RE = re.compile(r"^(\d+(?:\.\d+)?)ms$")
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class NetnsError(ParallaxError):
    """Building or querying the emulated cluster failed; names the command and its stderr."""


@dataclass(frozen=True)
class LinkSpec:
    """The link between each host and the emulated switch (the same for every host).

    rate_mbit is per direction (upload and download are shaped separately); None: no shaping,
    so hosts talk as fast as the CPU moves bytes through veth. latency_ms: one-way delay on
    what each host sends (only where the kernel has netem)."""

    name: str = "unlimited"
    rate_mbit: float | None = None
    latency_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """"unlimited", "100mbit", "1gbit", "10gbit", "1gbit+0.1ms", "unlimited+2ms"."""
        clean = text.strip().lower()
        rate_text, _, latency_text = clean.partition("+")
        if rate_text == "unlimited":
            rate = None
        elif match := _RATE_RE.match(rate_text):
            rate = float(match[1]) * (1000.0 if match[2] == "gbit" else 1.0)
        else:
            raise _bad_link(text)
        latency = 0.0
        if latency_text or clean.endswith("+"):
            match = _LATENCY_RE.match(latency_text)
            if not match:
                raise _bad_link(text)
            latency = float(match[1])
        if (rate is not None and rate <= 0) or latency < 0:
            raise _bad_link(text)
        return cls(name=clean, rate_mbit=rate, latency_ms=latency)


def _bad_link(text: str) -> ConfigError:
    return ConfigError(f"link spec {text!r} is not understood; accepted forms: "
                       f"{', '.join(_LINK_FORMS)}")


def tbf_params(rate_mbit: float) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at rate_mbit.

    burst: 2 ms of traffic at the rate, at least 128 KiB. veth hands tbf whole TSO/GSO
    segments of up to 64 KiB; a bucket smaller than one segment makes tbf cut every segment
    (or drop it), and a bucket of only a few segments makes the sender stall on every timer
    tick, so TCP stays well below the rate. 2 ms at 10 Gbit/s is 2.5 MB, which keeps the
    long-run rate exact (tbf's long-run rate does not depend on the bucket) while bursts stay
    short compared to a training step.
    limit: the queue behind the bucket, 20 ms of traffic, at least 4 buckets: enough for TCP
    to fill the pipe without drops at every window increase, small enough that the queue adds
    little delay (a deep queue would hide the latency the benchmarks care about)."""
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(int(bytes_per_s * 0.002), 128 * 1024)
    limit = max(int(bytes_per_s * 0.020), 4 * burst)
    return burst, limit


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command; on failure raise NetnsError with the command and its stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(f"command failed ({proc.returncode}): {' '.join(argv)}: "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    # "12: pxb-v0@if11: <...>": the name is before "@" (veth peer) or ":".
    return [line.split(": ", 2)[1].split("@")[0] for line in out.splitlines() if ": " in line]


def _ns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def kill_all(list_pids: Callable[[], list[int]], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM every process `list_pids()` names, SIGKILL what is left after `grace`
    seconds (a namespace's or a CPU group's processes)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = list_pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = list_pids()
        if not pids:
            return


def _kill_namespace_processes(ns: str, grace: float = KILL_GRACE_S) -> None:
    """Without this a deleted namespace lives on (its processes keep it) and holds its
    addresses."""
    kill_all(lambda: _ns_pids(ns), grace)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def _prefix_links(prefix: str) -> list[str]:
    veth = re.compile(rf"^{re.escape(prefix)}-v\d+$")
    return [name for name in _links() if name == f"{prefix}br" or veth.match(name)]


def sweep(prefix: str = "pxb") -> list[str]:
    """Remove what a crashed run with this prefix left: namespaces `{prefix}-*` (after killing
    their processes), links `{prefix}br` / `{prefix}-vN`, and /etc/netns/{prefix}-*.
    Returns the names removed, so a caller can report a previous crash."""
    removed: list[str] = []
    etc = sorted(NETNS_ETC.glob(f"{prefix}-*")) if NETNS_ETC.is_dir() else []
    for ns in _namespaces():
        if ns.startswith(f"{prefix}-"):
            _delete_namespace(ns)
            removed.append(ns)
    for link in _prefix_links(prefix):
        # Deleting one end of a veth deletes both; the bridge goes last, which is harmless.
        if _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    for path in etc:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def available() -> str | None:
    """None if this process can build an emulated cluster, else why not (for a test's failure
    message or a harness's error): root, `ip` and `tc`, namespaces permitted, tbf present."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}` on PATH (apt-get install iproute2)"
    probe = f"pxbench-probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    try:
        _run(["ip", "-n", probe, "link", "set", "lo", "up"], check=False)
        tbf = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                    "1mbit", "burst", "32kb", "limit", "64kb"], check=False)
        if tbf.returncode != 0:
            return f"the kernel lacks the tbf qdisc: {tbf.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def subnet_for(prefix: str) -> str:
    """A /24 of 10.78.0.0/16 chosen by the prefix, so two benchmarks with different prefixes
    (run at once) get different addresses: "pxb" keeps 10.78.0, others hash to 10.78.1-250."""
    return "10.78.0" if prefix == "pxb" else f"10.78.{1 + zlib.crc32(prefix.encode()) % 250}"


def _address_in_use(address: str) -> str | None:
    """The interface that already has `address` (another cluster's bridge), if any."""
    out = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == address:
            return fields[1]
    return None


_LIVE: set[EmulatedCluster] = set()


@atexit.register
def _down_all() -> None:
    """An interpreter exit (a failed harness, Ctrl-C) must not leave namespaces behind."""
    for cluster in list(_LIVE):
        cluster.down()


class EmulatedCluster:
    """Namespaces `{prefix}-{host}` at {subnet}.1, .2, ... on bridge `{prefix}br`
    ({subnet}.254, the root namespace's address: `gateway`). Use as a context manager, or
    up()/down(). Run a process on a host with `exec_prefix(host) + argv`. The subnet
    defaults to one chosen by the prefix (`subnet_for`), so clusters of different prefixes
    can be up at once; up() refuses a subnet whose gateway address is already in use."""

    def __init__(self, hosts: Sequence[str], link: LinkSpec, prefix: str = "pxb",
                 subnet: str | None = None) -> None:
        self.hosts = list(hosts)
        self.link = link
        self.prefix = prefix
        subnet = subnet_for(prefix) if subnet is None else subnet
        self.subnet = subnet
        self.gateway = f"{subnet}.254"
        self.latency_emulated = False
        self.latency_note = "no latency requested"
        _validate(self.hosts, prefix, subnet)

    # --- naming -------------------------------------------------------------------------
    def namespace(self, host: str) -> str:
        self._index(host)
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self._index(host) + 1}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host)]

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def _veth(self, i: int) -> str:
        """Bridge-side end of host i's link (the namespace end is renamed eth0)."""
        return f"{self.prefix}-v{i}"

    def _index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise ConfigError(f"host {host!r} is not in this cluster; hosts: "
                              f"{', '.join(self.hosts)}") from None

    # --- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> EmulatedCluster:
        """Build everything; on any failure remove what was made and raise NetnsError."""
        reason = available()
        if reason:
            raise NetnsError(f"cannot build an emulated cluster: {reason}")
        sweep(self.prefix)
        holder = _address_in_use(self.gateway)
        if holder:
            raise NetnsError(f"the bridge address {self.gateway} is already on {holder}: "
                             f"another emulated cluster uses subnet {self.subnet}; give this "
                             f"one another prefix (--prefix) or subnet")
        self.latency_emulated = False
        self.latency_note = ("no latency requested" if self.link.latency_ms <= 0
                             else "latency not set up yet")
        _LIVE.add(self)
        try:
            self._make_bridge()
            for i, host in enumerate(self.hosts):
                self._make_host(i, host)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill every process in the namespaces, delete namespaces, veths, the bridge and the
        /etc/netns entries. Idempotent; ignores what is already gone."""
        for host in self.hosts:
            _delete_namespace(self.namespace(host))
        for i in range(len(self.hosts)):
            _run(["ip", "link", "del", self._veth(i)], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        _LIVE.discard(self)

    def _make_bridge(self) -> None:
        """The switch. Multicast snooping is off: with it the bridge joins 224.0.0.106 and
        floods IGMP reports to every port, bytes no benchmark process sent."""
        _run(["ip", "link", "add", self.bridge, "type", "bridge", "mcast_snooping", "0"])
        _quiet_ipv6([], self.bridge)
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])

    def _make_host(self, i: int, host: str) -> None:
        ns, veth, peer = self.namespace(host), self._veth(i), f"{self.prefix}-p{i}"
        _run(["ip", "netns", "add", ns])
        self._write_hosts_file(ns, host)
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "netns", ns])
        _run(["ip", "-n", ns, "link", "set", peer, "name", "eth0"])
        _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"])
        _quiet_ipv6(["-n", ns], "eth0")
        _quiet_ipv6([], veth)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "link", "set", veth, "master", self.bridge])
        _run(["ip", "link", "set", veth, "up"])
        self._shape(["-n", ns], "eth0", latency=True)   # what the host sends
        self._shape([], veth, latency=False)             # what the host receives

    def _write_hosts_file(self, ns: str, host: str) -> None:
        """`ip netns exec` bind-mounts /etc/netns/NS/hosts over /etc/hosts, so every host
        resolves the others by name. This machine's hostname resolves to the host's own
        address: Horovod's gloo advertises what the hostname resolves to, and the shared
        /etc/hosts maps it to 127.0.0.1, unreachable from other namespaces."""
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.address(h)} {h}" for h in self.hosts]
        machine = socket.gethostname()
        if machine and machine not in self.hosts:
            lines.append(f"{self.address(host)} {machine}")
        (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / ns / "hosts").write_text("\n".join(lines) + "\n")

    def _shape(self, where: list[str], dev: str, *, latency: bool) -> None:
        """tbf for the rate, under a netem root when latency is requested and available."""
        parent = ["root"]
        if latency and self.link.latency_ms > 0:
            if self._add_netem(where, dev):
                parent = ["parent", "1:1"]
        if self.link.rate_mbit is not None:
            burst, limit = tbf_params(self.link.rate_mbit)
            _run(["tc", *where, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
                  "rate", f"{self.link.rate_mbit}mbit", "burst", str(burst),
                  "limit", str(limit)])

    def _add_netem(self, where: list[str], dev: str) -> bool:
        """Try netem once per cluster; if the kernel lacks it, note why and go on without."""
        if self.latency_note.startswith("netem unavailable"):
            return False
        proc = _run(["tc", *where, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                     "delay", f"{self.link.latency_ms}ms"], check=False)
        if proc.returncode != 0:
            self.latency_emulated = False
            self.latency_note = (f"netem unavailable, {self.link.latency_ms} ms latency not "
                                 f"emulated: {proc.stderr.strip()}")
            return False
        self.latency_emulated = True
        self.latency_note = f"netem: {self.link.latency_ms} ms one-way on every host's egress"
        return True

    # --- measurement --------------------------------------------------------------------
    def counters(self) -> dict[str, tuple[int, int]]:
        """host -> (bytes sent, bytes received) by its eth0 since up().

        Read from the bridge-side veth in the root namespace (what it receives, the host sent;
        what it transmits, the host received): a file read instead of an `ip -n NS` process
        per host, so a sampler polling every 0.2 s does not eat the benchmark's CPU. veth
        counts the same bytes on both ends; tests check this against `ip -n NS -s link`."""
        result = {}
        for i, host in enumerate(self.hosts):
            stats = SYS_NET / self._veth(i) / "statistics"
            try:
                received = int((stats / "tx_bytes").read_text())
                sent = int((stats / "rx_bytes").read_text())
            except OSError as err:
                raise NetnsError(f"cannot read the counters of host {host!r} ({stats}): "
                                 f"{err}; is the cluster up?") from err
            result[host] = (sent, received)
        return result

    def ns_counters(self, host: str) -> tuple[int, int]:
        """(tx, rx) bytes of eth0 as seen inside the namespace (slower; one process)."""
        out = _run(["ip", "-n", self.namespace(host), "-j", "-s", "link", "show", "dev",
                    "eth0"]).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def pids(self) -> list[int]:
        """Every process running in the cluster's namespaces (for the CPU sampler)."""
        return [pid for host in self.hosts for pid in _ns_pids(self.namespace(host))]


def _quiet_ipv6(where: list[str], dev: str) -> None:
    """No IPv6 link-local address on dev, hence no duplicate-address detection, router
    solicitations or MLD reports: otherwise every new link sends a few hundred bytes in its
    first seconds that the counters would charge to the benchmark. The cluster is IPv4 only
    (loopback keeps ::1)."""
    _run(["ip", *where, "link", "set", "dev", dev, "addrgenmode", "none"])


def _validate(hosts: list[str], prefix: str, subnet: str) -> None:
    if not hosts:
        raise ConfigError("an emulated cluster needs at least one host")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"host names must be unique; got {hosts}")
    if len(hosts) > 253:
        raise ConfigError(f"{len(hosts)} hosts do not fit in one /24 (at most 253)")
    for host in hosts:
        if not _HOST_RE.match(host):
            raise ConfigError(f"host name {host!r} may only use letters, digits, '_', '.', "
                              "'-' (it names a namespace and a hosts-file entry)")
    longest = len(f"{prefix}-v{len(hosts) - 1}")
    if not re.match(r"^[a-z][a-z0-9]*$", prefix) or longest > IFNAME_MAX:
        raise ConfigError(f"prefix {prefix!r} must be lowercase letters/digits and short "
                          f"enough for interface names (<= {IFNAME_MAX} chars; "
                          f"{prefix}-v{len(hosts) - 1} has {longest})")
    parts = subnet.split(".")
    if len(parts) != 3 or not all(p.isdigit() and int(p) < 256 for p in parts):
        raise ConfigError(f"subnet {subnet!r} must be the first three octets of a /24, "
                          "e.g. '10.78.0'")
