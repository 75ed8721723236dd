"""Host files for `parallax run --hosts FILE`: where the workers and parameter servers run.

Horovod's forms, and one of parallax's:

horovodrun's host file (`--hostfile`, or `--hosts FILE`), `host slots=N` lines (N workers,
default 1; one server per host; `user@host` sets the ssh user; CUDA_VISIBLE_DEVICES is left as
it is):

    10.0.0.1 slots=4
    worker-b slots=2

A host string instead of a file (`-H`, or `--hosts` when no such file exists) is horovodrun's
`host:N,host2:M`: N and M workers, one server per host, its port any free one (announced).

YAML, parallax's form, for what Horovod's cannot say: a mapping with a `hosts` list (`slots`
workers and `servers` parameter servers per host, default 1 each; `gpus`, the host's GPU ids,
one worker each, the worker of local rank i getting the i-th as its CUDA_VISIBLE_DEVICES,
`slots` then defaulting to their count) and optional `server_port` (the first server port
on each host, default 7000; a host's servers use consecutive ports from it),
`ssh_user`/`ssh_port` for every host, and `network_interface`, the interface(s) Horovod's
workers talk over (horovodrun --network-interfaces; default: Horovod's choice among the
interfaces all hosts have):

    server_port: 7000
    ssh_user: root
    hosts:
      - {host: 10.0.0.1, gpus: [0, 1]}
      - {host: 10.0.0.2, slots: 2, servers: 1, ssh_port: 2222}

Deprecated, still read (with a warning that gives the file as YAML): parallax's earlier
`host: 0,1,2` lines, the host's GPU ids (YAML's `gpus`).

Run as `python -m parallax.launch.hosts serve SERVER_ARGV...` it is the wrapper the launcher starts
over ssh: it runs the server and stops it (SIGTERM, then SIGKILL) when its standard input
closes, which happens when the launcher's ssh client ends, so no server outlives its job.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from parallax.client.local_cluster import (SERVER_COMMAND, ServerProcess, metrics_args,
                                          stop_servers)
from parallax.env import WORKER_RANK_ENV, WORKERS_ENV
from parallax.errors import ConfigError, ParallaxError
from parallax.launch.module_argv import own_module
from parallax.runtime import leftovers, lifeline

log = logging.getLogger("parallax")

DEFAULT_SERVER_PORT = 7000
_HOSTNAME = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_HOST_KEYS = {"host", "slots", "servers", "ssh_user", "ssh_port", "gpus"}
_TOP_KEYS = {"hosts", "server_port", "ssh_user", "ssh_port", "network_interface"}


@dataclass(frozen=True)
class HostSpec:
    host: str
    slots: int = 1                 # workers on this host
    servers: int = 1               # parameter servers on this host
    ssh_user: str | None = None    # None: ssh's default (the current user or ~/.ssh/config)
    ssh_port: int | None = None    # None: ssh's default (22 or ~/.ssh/config)
    gpus: tuple[int, ...] = ()     # GPU ids (YAML's gpus), one a worker: CUDA_VISIBLE_DEVICES

    @property
    def ssh_target(self) -> str:
        return f"{self.ssh_user}@{self.host}" if self.ssh_user else self.host


@dataclass(frozen=True)
class ClusterLayout:
    hosts: tuple[HostSpec, ...]
    server_port: int = DEFAULT_SERVER_PORT  # 0: any free port (a host string's servers)
    network_interface: str | None = None  # horovodrun --network-interfaces (e.g. eth0)

    @property
    def num_slots(self) -> int:
        return sum(h.slots for h in self.hosts)

    @property
    def num_servers(self) -> int:
        return sum(h.servers for h in self.hosts)

    def server_addresses(self) -> list[str]:
        """host:port of every server, host by host, in the order the launcher starts them."""
        return [f"{h.host}:{self.server_port + i}" for h in self.hosts for i in range(h.servers)]

    def horovod_hosts(self, num_workers: int | None = None) -> str:
        """`-H` for horovodrun: host:slots,... for the first num_workers slots."""
        left = self.num_slots if num_workers is None else num_workers
        parts = []
        for h in self.hosts:
            take = min(h.slots, left)
            if take:
                parts.append(f"{h.host}:{take}")
            left -= take
        return ",".join(parts)


def load_hosts(path: str | Path) -> ClusterLayout:
    """Read a host file in any format, or (a string naming no file) parse a horovodrun host
    string like `localhost:2,worker-b:2`; ConfigError names the file, the line and the fix."""
    if isinstance(path, str) and _HOST_STRING.match(path) and not Path(path).exists():
        return parse_host_string(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--hosts {path}: cannot read it ({exc.strerror or exc}); give the "
                          f"path of a host file, or hosts as horovodrun's host:slots,... "
                          f"(e.g. localhost:2)") from None
    return parse_hosts(text, str(path))


# a line of parallax's deprecated form: `host:` (an IPv6 address in brackets), then ids
_GPU_LINE = re.compile(r"^\s*(?:\[[^\]]*\]|[^\s:#\[]+)\s*:", re.MULTILINE)


def parse_hosts(text: str, source: str = "<hosts>") -> ClusterLayout:
    """YAML, else horovodrun's host file; a file of `host: ids` lines is read as before, with
    a deprecation warning (once per file) that gives it as YAML."""
    if re.search(r"^hosts\s*:", text, re.MULTILINE) or re.match(r"\s*\{", text):
        return _parse_yaml(text, source)
    if re.search(r"^[^#:]*\sslots\s*=", text, re.MULTILINE) or not _GPU_LINE.search(text):
        return _parse_hostfile(text, source)
    layout = _parse_lines(text, source)
    _warn_gpu_lines(layout, source)
    return layout


_warned_sources: set[str] = set()


def _warn_gpu_lines(layout: ClusterLayout, source: str) -> None:
    if source in _warned_sources:
        return
    _warned_sources.add(source)
    log.warning("%s: `host: 0,1` lines are deprecated (they still work); write Horovod's "
                "`host slots=N` lines, or, to keep the GPU ids, YAML: %s", source,
                as_yaml(layout))


def as_yaml(layout: ClusterLayout) -> str:
    """The layout as one line of the YAML form (what a deprecated host file becomes)."""
    def host(h: HostSpec) -> str:
        fields = [f"host: {h.host}"] + ([f"ssh_user: {h.ssh_user}"] if h.ssh_user else []) + \
            ([f"gpus: [{', '.join(map(str, h.gpus))}]"] if h.gpus else [])
        return "{" + ", ".join(fields) + "}"
    return "hosts: [" + ", ".join(host(h) for h in layout.hosts) + "]"


_HOST_STRING = re.compile(r"^[^,:\s/]+:\d+(,[^,:\s/]+:\d+)*$")


def parse_host_string(text: str, source: str = "-H") -> ClusterLayout:
    """horovodrun's `-H host:N,host2:M`: N workers on host, M on host2, one server on each,
    at any free port."""
    hosts = []
    for part in text.split(","):
        name, _, slots = part.strip().rpartition(":")
        where = f"{source} {text}"
        if not slots.isdigit() or int(slots) < 1:
            raise ConfigError(f"{where}: {part!r} should be host:N with N >= 1 workers "
                              f"(e.g. localhost:2)")
        hosts.append((_host(name, int(slots), where), where))
    return _layout(hosts, 0, f"{source} {text}")


def parse_discovered(text: str, source: str) -> ClusterLayout:
    """A host discovery script's output (Horovod Elastic's): `host:N` or `host` (1 slot)
    lines, one server placed on none of them (an elastic job's servers are fixed)."""
    hosts = []
    for line, raw, where in _lines(text, source):
        name, sep, slots = line.rpartition(":") if ":" in line else ("", "", line)
        name, slots = (name, slots) if sep else (slots, "1")
        if not slots.isdigit() or int(slots) < 1:
            raise ConfigError(f"{where}: {raw.strip()!r} should be `host:N` (N >= 1 slots) "
                              f"or `host`")
        spec = _host(name, int(slots), where)
        hosts.append((HostSpec(spec.host, spec.slots, 0, spec.ssh_user), where))
    return _layout(hosts, 0, source) if hosts else ClusterLayout(())


_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?$")


def _parse_hostfile(text: str, source: str) -> ClusterLayout:
    """horovodrun's (and mpirun's) host file: `host slots=N` lines (default 1 slot)."""
    hosts = []
    for line, raw, where in _lines(text, source):
        match = _HOSTFILE_LINE.match(line)
        slots = match["slots"] if match and match["slots"] is not None else "1"
        if match is None or not slots.isdigit() or int(slots) < 1:
            raise ConfigError(f"{where}: {raw.strip()!r} should be `host slots=N` (N >= 1 "
                              f"workers on that host)")
        hosts.append((_host(match["host"], int(slots), where), where))
    return _layout(hosts, DEFAULT_SERVER_PORT, source)


def _port(value, where: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{where}: {what} {value!r} is not a port; give a number in 1-65535")
    return value


def _check_host(host, where: str) -> str:
    if not isinstance(host, str) or not _HOSTNAME.match(host):
        raise ConfigError(f"{where}: {host!r} is not a host name or address; write e.g. "
                          f"10.0.0.1 or worker-a")
    return host


def _check_user(user, where: str) -> str | None:
    if user is not None and (not isinstance(user, str) or not _USER.match(user)):
        raise ConfigError(f"{where}: ssh_user {user!r} is not a user name")
    return user


def _host(name: str, slots: int, where: str, gpus: tuple[int, ...] = ()) -> HostSpec:
    """A host of the line formats: `[user@]host`, checked, with one parameter server."""
    user, _, name = name.strip().rpartition("@")
    return HostSpec(_check_host(name, where), slots, 1, _check_user(user or None, where),
                    gpus=gpus)


def _layout(hosts: list[tuple[HostSpec, str]], server_port: int, source: str,
            network_interface: str | None = None) -> ClusterLayout:
    if not hosts:
        raise ConfigError(f"{source}: no hosts; list at least one (e.g. `localhost slots=1`, "
                          f"or `hosts: [{{host: localhost, slots: 1}}]` in YAML)")
    seen: dict[str, str] = {}
    for spec, where in hosts:
        if spec.host in seen:
            raise ConfigError(f"{where}: host {spec.host!r} is listed again (first at "
                              f"{seen[spec.host]}); give each host once, with all its slots")
        seen[spec.host] = where
    top = server_port + max(h.servers for h, _ in hosts) - 1
    if server_port and top > 65535:
        raise ConfigError(f"{source}: server_port {server_port} leaves no room for "
                          f"{top - server_port + 1} servers on one host (ports up to {top}); "
                          f"choose a lower server_port")
    return ClusterLayout(tuple(spec for spec, _ in hosts), server_port, network_interface)


def _lines(text: str, source: str):
    """(the line without its comment, the line as written, "SOURCE, line N") of each line
    that says something."""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            yield line, raw, f"{source}, line {number}"


def _parse_lines(text: str, source: str) -> ClusterLayout:
    hosts = []
    for line, raw, where in _lines(text, source):
        name, sep, ids = line.partition(":")
        slots = 1
        if sep:
            items = [i.strip() for i in ids.split(",")]
            if not ids.strip() or not all(i.isdigit() for i in items):
                raise ConfigError(f"{where}: {raw.strip()!r} should be `host: 0,1,2` (the "
                                  f"host's GPU/slot ids, comma-separated; one worker each)")
            if len(set(items)) != len(items):
                raise ConfigError(f"{where}: slot ids {ids.strip()!r} repeat one; list each "
                                  f"id once")
            slots = len(items)
        gpus = tuple(int(i) for i in items) if sep else ()
        hosts.append((_host(name, slots, where, gpus), where))
    return _layout(hosts, DEFAULT_SERVER_PORT, source)


def _parse_yaml(text: str, source: str) -> ClusterLayout:
    import yaml
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f", line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{at}: not valid YAML ({getattr(exc, 'problem', exc)}); "
                          f"see `hosts: [{{host: 10.0.0.1, slots: 2}}]`") from None

    def line(node) -> str:
        return f"{source}, line {node.start_mark.line + 1}"

    def value(node):
        return yaml.SafeLoader(text).construct_object(node, deep=True)

    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{source}: expected a mapping with a `hosts` list")
    top = {}
    for key, node in root.value:
        if key.value not in _TOP_KEYS:
            raise ConfigError(f"{line(key)}: unknown key {key.value!r}; the keys are "
                              f"{', '.join(sorted(_TOP_KEYS))}")
        top[key.value] = node
    server_port = DEFAULT_SERVER_PORT
    if "server_port" in top:
        server_port = _port(value(top["server_port"]), line(top["server_port"]), "server_port")
    default_user = _check_user(value(top["ssh_user"]), line(top["ssh_user"])) \
        if "ssh_user" in top else None
    default_port = _port(value(top["ssh_port"]), line(top["ssh_port"]), "ssh_port") \
        if "ssh_port" in top else None
    nic = None
    if "network_interface" in top:
        nic = value(top["network_interface"])
        if not isinstance(nic, str) or not re.match(r"^[A-Za-z0-9_.@:,-]+$", nic):
            raise ConfigError(f"{line(top['network_interface'])}: network_interface {nic!r} "
                              f"should be an interface name like eth0 (or eth0,eth1)")
    if "hosts" not in top or not isinstance(top["hosts"], yaml.SequenceNode):
        where = line(top["hosts"]) if "hosts" in top else source
        raise ConfigError(f"{where}: `hosts` must be a list, e.g. `hosts: [{{host: 10.0.0.1, "
                          f"slots: 2}}]`")
    hosts = []
    for item in top["hosts"].value:
        where = line(item)
        if isinstance(item, yaml.ScalarNode):  # `- 10.0.0.1`: one slot, one server
            hosts.append((HostSpec(_check_host(value(item), where), 1, 1, default_user,
                                   default_port), where))
            continue
        if not isinstance(item, yaml.MappingNode):
            raise ConfigError(f"{where}: each host is a mapping like {{host: 10.0.0.1, "
                              f"slots: 2}}")
        fields = {}
        for key, node in item.value:
            if key.value not in _HOST_KEYS:
                raise ConfigError(f"{line(key)}: unknown host key {key.value!r}; the keys are "
                                  f"{', '.join(sorted(_HOST_KEYS))}")
            fields[key.value] = (value(node), line(node))
        if "host" not in fields:
            raise ConfigError(f"{where}: this host has no `host:` (its name or address)")
        gpus = _yaml_gpus(*fields.get("gpus", ([], where)))
        slots, slots_at = fields.get("slots", (len(gpus) or 1, where))
        if gpus and slots != len(gpus):
            raise ConfigError(f"{slots_at}: slots {slots!r} but {len(gpus)} gpus: one worker "
                              f"runs per GPU id; drop slots, or list {slots!r} ids")
        servers, servers_at = fields.get("servers", (1, where))
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"{slots_at}: slots {slots!r} must be a whole number >= 1 (the "
                              f"host's workers); drop the host to run none there")
        if isinstance(servers, bool) or not isinstance(servers, int) or servers < 0:
            raise ConfigError(f"{servers_at}: servers {servers!r} must be a whole number >= 0")
        ssh_port = default_port
        if "ssh_port" in fields:
            ssh_port = _port(fields["ssh_port"][0], fields["ssh_port"][1], "ssh_port")
        user = default_user
        if "ssh_user" in fields:
            user = _check_user(fields["ssh_user"][0], fields["ssh_user"][1])
        hosts.append((HostSpec(_check_host(str(fields["host"][0]), fields["host"][1]), slots,
                               servers, user, ssh_port, gpus=gpus), where))
    return _layout(hosts, server_port, source, nic)


def _yaml_gpus(ids, where: str) -> tuple[int, ...]:
    """A YAML host's `gpus`: distinct GPU ids (whole numbers >= 0), one worker each."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and i >= 0 for i in ids):
        raise ConfigError(f"{where}: gpus {ids!r} must be a list of GPU ids, e.g. [0, 1]")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: gpus {ids!r} repeat an id; list each once")
    return tuple(ids)


def is_local(host: str) -> bool:
    """Whether `host` names this machine (network namespace included): loopback, or an
    address that a socket here can bind to."""
    name = host.strip("[]")
    if name in ("localhost", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        ip = ipaddress.ip_address(address[0])
        if ip.is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


class HostCluster:
    """The servers of a host file's layout, started like `LocalCluster`'s (same `servers`,
    `addresses`, `stop()`): on this machine as child processes bound to the host's address,
    elsewhere over ssh under the `serve` wrapper, at fixed ports from `server_port`."""

    def __init__(self, layout: ClusterLayout, *, data_dir: str | None = None,
                 extra_args: list[str] | None = None, echo=None,
                 start_timeout: float = 60.0, metrics_port: int | None = None) -> None:
        self.layout = layout
        self.metrics_port = metrics_port  # local_cluster.metrics_args, per host
        self.data_dir = data_dir
        self.extra_args = list(extra_args or [])
        self.echo = echo
        self.start_timeout = start_timeout
        self.servers: list = []
        self.exit_codes: list[int | None] = []

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers if s.address]

    def start(self) -> "HostCluster":
        data_dir = os.path.abspath(self.data_dir) if self.data_dir is not None else None
        try:
            for host in self.layout.hosts:
                for i in range(host.servers):
                    port = self.layout.server_port + i if self.layout.server_port else 0
                    args = ["--host", host.host.strip("[]"), "--port", str(port),
                            *self.extra_args, *self._metrics(host, i)]
                    if data_dir is not None:
                        args += ["--data-dir", data_dir]
                    index = len(self.servers)
                    if is_local(host.host):
                        self.servers.append(ServerProcess(index, [*SERVER_COMMAND, *args],
                                                          self.echo))
                    else:
                        self.servers.append(_RemoteServer(index, host, args, self.echo))
            for server in self.servers:
                server.wait_ready(self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _metrics(self, host: HostSpec, index: int) -> list[str]:
        """The i-th server of a host serves /metrics on the host's address (scrapeable from
        the other hosts; loopback stays loopback)."""
        args = metrics_args(self.metrics_port, index)
        return [*args, "--metrics-host", host.host.strip("[]")] if args else []

    def stop(self, timeout: float = 15.0) -> list[int | None]:
        self.exit_codes = stop_servers(self.servers, timeout)
        return self.exit_codes


def worker_hosts(layout: ClusterLayout, num_workers: int) -> list[tuple[HostSpec, str, int]]:
    """(host, its name for horovodrun -H and HOROVOD_HOSTNAME, its workers) of the first
    num_workers slots."""
    left, hosts = num_workers, []
    for h in layout.hosts:
        take = min(h.slots, left)
        left -= take
        if take:
            hosts.append((h, h.host if is_local(h.host) else h.ssh_target, take))
    return hosts


def with_devices(layout: ClusterLayout, num_workers: int, program: list[str]) -> list[str]:
    """The program, run through `python -m parallax.launch.hosts gpus` when the layout names slot
    ids: each worker gets its id as CUDA_VISIBLE_DEVICES (see `_gpus`)."""
    pairs = [f"{name}={','.join(map(str, h.gpus[:take]))}"
             for h, name, take in worker_hosts(layout, num_workers) if h.gpus]
    if not pairs:
        return program
    return [*own_module("parallax.launch.hosts"), "gpus", *pairs, "--", *program]


def ssh_command(host: HostSpec, remote_argv: list[str]) -> list[str]:
    import shlex
    import shutil
    ssh = shutil.which("ssh")
    if ssh is None:
        raise ConfigError(f"host {host.host} is not this machine, and ssh is not on PATH: "
                          f"install an ssh client (Debian: openssh-client)")
    port = ["-p", str(host.ssh_port)] if host.ssh_port is not None else []
    return [ssh, "-o", "BatchMode=yes", *port, host.ssh_target, shlex.join(remote_argv)]


def copy_directory_to_hosts(layout: ClusterLayout, directory: str | Path) -> list[HostSpec]:
    """Copy the files of `directory` (e.g. a job's credentials) to the same path on every
    host that is not this machine, private (0700 directory, 0600 files), over ssh; returns
    the hosts copied to, for `remove_directory_from_hosts`."""
    import shlex
    directory = Path(directory)
    remote = [h for h in {h.ssh_target: h for h in layout.hosts}.values() if not is_local(h.host)]
    for host in remote:
        quoted = shlex.quote(str(directory))
        _ssh_checked(host, f"umask 077 && mkdir -p {quoted}", b"")
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            target = shlex.quote(str(path))
            _ssh_checked(host, f"umask 077 && cat > {target}", path.read_bytes())
    return remote


def remove_directory_from_hosts(hosts: list[HostSpec], directory: str | Path) -> None:
    import shlex
    for host in hosts:
        subprocess.run(ssh_command(host, ["sh", "-c", f"rm -rf {shlex.quote(str(directory))}"]),
                       input=b"", capture_output=True, timeout=30)


def _ssh_checked(host: HostSpec, script: str, data: bytes) -> None:
    proc = subprocess.run(ssh_command(host, ["sh", "-c", script]), input=data,
                          capture_output=True, timeout=60)
    if proc.returncode != 0:
        raise ParallaxError(f"could not copy the job's credentials to {host.ssh_target} over "
                            f"ssh (exit {proc.returncode}): "
                            f"{proc.stderr.decode(errors='replace').strip()[-500:]}")


class _RemoteServer(ServerProcess):
    """A server on another host: `ssh HOST python -m parallax.launch.hosts serve <server argv>`, its
    READY line and output read from ssh's stdout; ssh's stdin stays open until close()."""

    def __init__(self, index: int, host: HostSpec, args: list[str], echo) -> None:
        self.host = host
        super().__init__(index, ssh_command(host, [
            *own_module("parallax.launch.hosts"), "serve",
            *own_module("parallax_ps", ("-u",)), *args]), echo, stdin=subprocess.PIPE)

    def request_stop(self) -> None:
        """Close ssh's stdin: the remote wrapper stops its server, then ssh exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass


def _serve(argv: list[str]) -> int:
    """Run argv; stop it when stdin reaches EOF or on SIGTERM/SIGHUP; exit with its code."""
    import signal

    proc = subprocess.Popen(lifeline.dying_with(argv, os.getpid()), stdin=subprocess.DEVNULL,
                            env=lifeline.child_env())  # the program ends with this wrapper

    def stop(*_):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def watch_stdin():
        try:
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except OSError:
            pass
        stop()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=stop, daemon=True).start())
    threading.Thread(target=watch_stdin, daemon=True).start()
    code = proc.wait()
    leftovers.end_holders([1, 2], f"{Path(argv[0]).name} on {socket.gethostname()}")
    return 128 - code if code < 0 else code


def _gpus(argv: list[str], environ=None) -> list[str]:
    """`HOST=ID,... [HOST=ID,...] -- COMMAND`: set CUDA_VISIBLE_DEVICES to the id of this
    worker (its host's list, its local rank-th: Horovod's HOROVOD_HOSTNAME and
    HOROVOD_LOCAL_RANK, or the TensorFlow supervisor's PARALLAX_WORKERS and
    PARALLAX_WORKER_RANK); returns COMMAND. A host not listed keeps CUDA_VISIBLE_DEVICES."""
    environ = os.environ if environ is None else environ
    split = argv.index("--") if "--" in argv else len(argv)
    ids = dict(pair.split("=", 1) for pair in argv[:split])
    if "HOROVOD_HOSTNAME" in environ:
        name, rank = environ["HOROVOD_HOSTNAME"], int(environ.get("HOROVOD_LOCAL_RANK", "0"))
    else:
        name, rank = _supervised_slot(ids, environ)
    mine = ids.get(name, "").split(",") if ids.get(name) else []
    if rank < len(mine):
        environ["CUDA_VISIBLE_DEVICES"] = mine[rank]
    return argv[split + 1:]


def _supervised_slot(ids: dict[str, str], environ) -> tuple[str, int]:
    """(the name in `ids` of this worker's host, its rank there) from PARALLAX_WORKERS and
    PARALLAX_WORKER_RANK; the first host and rank 0 without them."""
    if not environ.get(WORKERS_ENV):
        return next(iter(ids), ""), 0
    hosts = [a.rsplit(":", 1)[0].strip("[]") for a in environ[WORKERS_ENV].split(",")]
    me = int(environ.get(WORKER_RANK_ENV, "0"))
    mine = hosts[me]
    names = {n: "127.0.0.1" if n == "localhost" else n.rpartition("@")[2].strip("[]")
             for n in ids}
    name = next((n for n, host in names.items() if host == mine), "")
    if not name and is_local(mine):  # this machine, named by its address toward the others
        name = next((n for n in names if is_local(n)), "")
    return name, hosts[:me].count(mine)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "gpus":
        command = _gpus(sys.argv[2:])
        os.execvp(command[0], command)
    if len(sys.argv) < 3 or sys.argv[1] != "serve":
        sys.exit("usage: python -m parallax.launch.hosts serve|gpus ... COMMAND [ARGS ...]")
    sys.exit(_serve(sys.argv[2:]))
