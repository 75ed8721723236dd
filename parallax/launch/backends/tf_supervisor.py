"""The TensorFlow backend's supervisor (`parallax.launch.backends.tfrun`): N workers, on this
machine and over ssh, each told where all of them are, with horovodrun's output contract.

    python -m parallax.launch.backends.tf_supervisor --hosts JSON -- PROGRAM...

JSON lists the hosts in rank order, `[{"host": ADDRESS, "workers": K}, ...]`, where a host
that is not this machine also has "ssh_target" (and "ssh_port"). The supervisor picks a free
port per worker on each host (over ssh for the others), then starts the
workers with `PARALLAX_WORKERS` (every worker's ADDRESS:port) and `PARALLAX_WORKER_RANK`.
A worker here ends with the supervisor (`parallax.runtime.lifeline`). A worker elsewhere runs
under `python -m parallax.launch.hosts serve` in the supervisor's working directory and with
its environment (as horovodrun forwards it), and ends when its ssh connection closes.

Each worker's output line is printed prefixed `[rank]<stdout>:` (its stderr's to stderr,
`[rank]<stderr>:`); a worker that fails is
reported as `Process RANK exit with status code CODE.`, the first failure first, then the
others are stopped and the supervisor exits 1. It exits 0 once every worker did; SIGTERM or
SIGINT stops every worker.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from parallax.env import PARENT_ENV, WORKER_RANK_ENV, WORKERS_ENV
from parallax.errors import ConfigError
from parallax.launch.module_argv import own_module
from parallax.runtime import leftovers, lifeline

STOP_GRACE_S = 10.0  # after a failure: how long the other workers have to stop on SIGTERM
PORTS_TIMEOUT_S = 60.0  # for the ssh call that asks a remote host for free ports
# Not forwarded to a worker on another host: that host's own (its user, shell, terminal,
# ssh session), and the supervisor's pid, which means nothing there
_LOCAL_ONLY = re.compile(r"^(HOME|USER|LOGNAME|SHELL|PWD|OLDPWD|SHLVL|_|TERM|HOSTNAME|MAIL|"
                         r"DISPLAY|SSH_.*|XDG_.*|BASH_FUNC_.*|" + PARENT_ENV + r")$")


@dataclass(frozen=True)
class WorkerHost:
    """A host of the job and how many workers it runs, in rank order (`--hosts`)."""
    host: str
    workers: int
    ssh_target: str | None = None  # None: this machine
    ssh_port: int | None = None

    def ssh(self, remote_argv: list[str]) -> list[str]:
        from parallax.launch.hosts import HostSpec, ssh_command
        user, _, name = (self.ssh_target or "").rpartition("@")
        return ssh_command(HostSpec(name, self.workers, ssh_user=user or None,
                                    ssh_port=self.ssh_port), remote_argv)


def parse_hosts(text: str) -> list[WorkerHost]:
    try:
        hosts = [WorkerHost(**entry) for entry in json.loads(text)]
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--hosts {text!r}: not a JSON list of {{host, workers[, "
                          f"ssh_target, ssh_port]}} ({err})") from None
    if not hosts or any(h.workers < 1 for h in hosts):
        raise ConfigError(f"--hosts {text!r}: give at least one host, each with workers >= 1")
    return hosts


# `free_addresses`, for another host: a bare interpreter there, whatever parallax it has
_FREE_PORTS = """
import socket, sys
host, count = sys.argv[1], int(sys.argv[2])
family = socket.AF_INET6 if ":" in host else socket.AF_INET
sockets = [socket.socket(family) for _ in range(count)]
for s in sockets:
    s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
bracket = "[%s]" % host if ":" in host else host
print("\\n".join("%s:%d" % (bracket, s.getsockname()[1]) for s in sockets))
"""


def free_addresses(host: str, count: int) -> list[str]:
    """`count` host:port whose ports the OS just handed out on every interface (TensorFlow's
    server binds the wildcard address, whatever host it is told), held together so no two
    are the same."""
    try:
        proc = subprocess.run([sys.executable, "-c", _FREE_PORTS, host, str(count)],
                              capture_output=True, text=True, timeout=PORTS_TIMEOUT_S,
                              check=True)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        raise ConfigError(f"could not get {count} free port(s) on {host}: {detail}") from None
    return proc.stdout.split()


def host_addresses(host: WorkerHost) -> list[str]:
    """Free addresses for `host`'s workers, probed here or over ssh."""
    if host.ssh_target is None:
        return free_addresses(host.host, host.workers)
    argv = host.ssh([sys.executable, "-c", _FREE_PORTS, host.host, str(host.workers)])
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=PORTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{host.ssh_target} did not answer over ssh within "
                          f"{PORTS_TIMEOUT_S:.0f} s (asked for free ports)") from None
    addresses = proc.stdout.decode(errors="replace").split()
    if proc.returncode != 0 or len(addresses) != host.workers:
        raise ConfigError(f"could not get {host.workers} free port(s) on {host.ssh_target} "
                          f"over ssh (exit {proc.returncode}): "
                          f"{proc.stderr.decode(errors='replace').strip()[-500:]}")
    return addresses


def forwarded(env: dict[str, str]) -> dict[str, str]:
    """What of `env` a worker on another host gets (the rest is that host's own)."""
    return {k: v for k, v in env.items()
            if not _LOCAL_ONLY.match(k) and re.fullmatch(r"[A-Za-z_]\w*", k)}


def remote_command(host: WorkerHost, program: list[str], env: dict[str, str]) -> list[str]:
    """ssh running `program` on `host` in this working directory with `env`'s exportable
    variables, under the `serve` wrapper (it ends the program when ssh's stdin closes)."""
    exported = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(forwarded(env).items()))
    serve = shlex.join([*own_module("parallax.launch.hosts"), "serve", *program])
    script = f"cd {shlex.quote(os.getcwd())} && exec env {exported} {serve}"
    return host.ssh(["sh", "-c", script])


def exit_code(returncode: int) -> int:
    """A worker's exit code as horovodrun reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Supervisor:
    def __init__(self, program: list[str], hosts: list[WorkerHost]) -> None:
        self.lock = threading.Lock()
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (rank, code), as they end
        placed = [(host, a) for host in hosts for a in host_addresses(host)]
        addresses = [a for _, a in placed]
        self.procs: list[subprocess.Popen] = []
        try:
            for rank, (host, _) in enumerate(placed):
                self.procs.append(self._start(program, host, addresses, rank))
        except OSError as err:
            self.stop(self.procs)
            raise ConfigError(f"could not start worker {len(self.procs)}: {err}") from None
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True).start()

    @staticmethod
    def _start(program: list[str], host: WorkerHost, addresses: list[str], rank: int
               ) -> subprocess.Popen:
        env = {**os.environ, WORKERS_ENV: ",".join(addresses), WORKER_RANK_ENV: str(rank)}
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        if host.ssh_target is None:
            return subprocess.Popen(lifeline.dying_with(program, os.getpid()), env=env,
                                    **pipes)
        return subprocess.Popen(remote_command(host, program, env), stdin=subprocess.PIPE,
                                **pipes)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        """Relay worker `rank`'s stdout and stderr; then report its exit, once both are out
        (what it left holding them is ended: `leftovers`)."""
        relays = [threading.Thread(target=self._relay, args=(rank, stream, name, out),
                                   daemon=True)
                  for stream, name, out in ((proc.stdout, "stdout", sys.stdout),
                                            (proc.stderr, "stderr", sys.stderr))]
        for relay in relays:
            relay.start()
        code = exit_code(proc.wait())
        if any(relay.is_alive() for relay in relays):  # (a worker elsewhere: its ssh's pipes)
            leftovers.end_holders([proc.stdout.fileno(), proc.stderr.fileno()],
                                  f"worker rank {rank}")
        for relay in relays:
            relay.join()
        self.exits.put((rank, code))

    def _relay(self, rank: int, stream, name: str, out) -> None:
        """Each line of one of worker `rank`'s streams to the same stream here, prefixed as
        horovodrun prefixes it, `[rank]<stdout>:` or `[rank]<stderr>:` (a last line without
        its newline gets one)."""
        prefix = f"[{rank}]<{name}>:".encode()
        for line in stream:
            with self.lock:
                out.buffer.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
                out.buffer.flush()

    def say(self, text: str) -> None:
        with self.lock:
            sys.stdout.buffer.write(text.encode() + b"\n")
            sys.stdout.buffer.flush()

    def wait(self) -> int:
        """0 once every worker exited 0; else 1, after the first failure (in the order the
        workers ended) is reported and the other workers are stopped."""
        for _ in self.procs:
            rank, code = self._next_exit()
            if code != 0:
                self.say(f"Process {rank} exit with status code {code}.")
                self.stop(self.procs)
                return 1
        return 0

    def _next_exit(self) -> tuple[int, int]:
        while True:  # (a short timeout: SIGTERM's handler runs between the waits)
            try:
                return self.exits.get(timeout=0.5)
            except queue.Empty:
                continue

    def stop(self, procs) -> None:
        """Stop the workers still running: SIGTERM here; a remote one's ssh stdin closed (its
        wrapper then stops it); whatever is left after STOP_GRACE_S is killed."""
        procs = [p for p in procs if p.poll() is None]
        for proc in procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            else:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallax.launch.backends.tf_supervisor",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", help="JSON: the hosts in rank order (see the module's doc)")
    parser.add_argument("-np", type=int, dest="num_workers",
                        help="N workers on --host (default 127.0.0.1), instead of --hosts")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if (args.hosts is None) == (args.num_workers is None) or not program:
        parser.error("give --hosts JSON or -np N (N >= 1), and the program after --")
    try:
        hosts = parse_hosts(args.hosts) if args.hosts is not None else \
            parse_hosts(json.dumps([{"host": args.host, "workers": args.num_workers}]))
        supervisor = _Supervisor(program, hosts)
    except ConfigError as err:
        print(f"parallax: {err}", file=sys.stderr, flush=True)
        return 2

    def stop(signum, _frame) -> None:
        supervisor.stop(supervisor.procs)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return supervisor.wait()


if __name__ == "__main__":
    sys.exit(main())
