"""The TensorFlow backend's supervisor (`parallax.launch.backends.tfrun`): N workers on this
machine, each told where all of them are, with horovodrun's output contract.

    python -m parallax.launch.backends.tf_supervisor -np N [--host ADDRESS] -- PROGRAM...

It picks a free port per worker on ADDRESS, starts the N workers with `PARALLAX_WORKERS`
(every worker's ADDRESS:port) and `PARALLAX_WORKER_RANK`, each ending with the supervisor
(`parallax.runtime.lifeline`). Each worker's output line is printed prefixed `[rank]<stdout>:`;
a worker that fails is reported as `Process RANK exit with status code CODE.`, the first
failure first, then the others are stopped and the supervisor exits 1. It exits 0 once every
worker did; SIGTERM or SIGINT stops every worker.
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from parallax.env import WORKER_RANK_ENV, WORKERS_ENV
from parallax.runtime import lifeline

STOP_GRACE_S = 10.0  # after a failure: how long the other workers have to stop on SIGTERM


def free_addresses(host: str, count: int) -> list[str]:
    """`count` host:port whose ports the OS just handed out on every interface (TensorFlow's
    server binds the wildcard address, whatever host it is told), held together so no two
    are the same."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        bracket = f"[{host}]" if ":" in host else host
        return [f"{bracket}:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


def exit_code(returncode: int) -> int:
    """A worker's exit code as horovodrun reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Supervisor:
    def __init__(self, program: list[str], addresses: list[str]) -> None:
        self.lock = threading.Lock()
        self.exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (rank, code), as they end
        self.procs = [self._start(program, addresses, rank) for rank in range(len(addresses))]
        for rank, proc in enumerate(self.procs):
            threading.Thread(target=self._relay, args=(rank, proc), daemon=True).start()

    @staticmethod
    def _start(program: list[str], addresses: list[str], rank: int) -> subprocess.Popen:
        env = {**os.environ, WORKERS_ENV: ",".join(addresses), WORKER_RANK_ENV: str(rank)}
        return subprocess.Popen(lifeline.dying_with(program, os.getpid()), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def _relay(self, rank: int, proc: subprocess.Popen) -> None:
        """Each output line of worker `rank`, prefixed as horovodrun prefixes it (a last line
        without its newline gets one); then its exit, once its output is out."""
        assert proc.stdout is not None
        prefix = f"[{rank}]<stdout>:".encode()
        for line in proc.stdout:
            with self.lock:
                sys.stdout.buffer.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
                sys.stdout.buffer.flush()
        self.exits.put((rank, exit_code(proc.wait())))

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
        procs = [p for p in procs if p.poll() is None]
        for proc in procs:
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
    parser.add_argument("-np", type=int, required=True, dest="num_workers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if args.num_workers < 1 or not program:
        parser.error("give -np N (N >= 1) and the program after --")
    supervisor = _Supervisor(program, free_addresses(args.host, args.num_workers))

    def stop(signum, _frame) -> None:
        supervisor.stop(supervisor.procs)
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return supervisor.wait()


if __name__ == "__main__":
    sys.exit(main())
