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
    """`count` host:port the OS just handed out, held together so no two are the same."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        bracket = f"[{host}]" if ":" in host else host
        return [f"{bracket}:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


class _Supervisor:
    def __init__(self, program: list[str], addresses: list[str]) -> None:
        self.lock = threading.Lock()
        self.procs = [self._start(program, addresses, rank) for rank in range(len(addresses))]
        self.readers = [threading.Thread(target=self._relay, args=(rank, p), daemon=True)
                        for rank, p in enumerate(self.procs)]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _start(program: list[str], addresses: list[str], rank: int) -> subprocess.Popen:
        env = {**os.environ, WORKERS_ENV: ",".join(addresses), WORKER_RANK_ENV: str(rank)}
        return subprocess.Popen(lifeline.dying_with(program, os.getpid()), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def _relay(self, rank: int, proc: subprocess.Popen) -> None:
        """Each output line of worker `rank`, prefixed as horovodrun prefixes it."""
        assert proc.stdout is not None
        prefix = f"[{rank}]<stdout>:".encode()
        for line in proc.stdout:
            with self.lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    def say(self, text: str) -> None:
        with self.lock:
            sys.stdout.buffer.write(text.encode() + b"\n")
            sys.stdout.buffer.flush()

    def wait(self) -> int:
        """0 once every worker exited 0; else 1, after the first failure is reported and
        the other workers are stopped."""
        running = dict(enumerate(self.procs))
        while running:
            for rank, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[rank]
                if code != 0:
                    self._finish_output()
                    self.say(f"Process {rank} exit with status code {code}.")
                    self.stop(running.values())
                    return 1
            time.sleep(0.05)
        self._finish_output()
        return 0

    def _finish_output(self) -> None:
        for reader in self.readers:
            reader.join(timeout=0.0 if reader is threading.current_thread() else 1.0)

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
