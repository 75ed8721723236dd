"""Gang restarts of a Kubernetes worker Job: `parallax k8s --max-restarts N`.

A Horovod job cannot re-admit one rank: its gloo context is formed once, by all ranks
together, through the rendezvous. Kubernetes restarts pods one at a time (a Job replaces the
failed pod of its index, `restartPolicy: OnFailure` restarts one container), which would
leave the surviving ranks in a dead context and the new one at a rendezvous that has closed.
So a failure is handled inside the pods, as `parallax run --max-restarts` does on hosts:
each pod's `parallax k8s worker` stays up as a supervisor and runs the training command as
its child, once per attempt, and worker 0's supervisor coordinates the attempts (`Gang`,
served beside Horovod's rendezvous store under /parallax/gang):

  starting  every rank has checked in: reset the rendezvous (a fresh gloo context) and drop
            the run's tables on the servers (`parallax run` starts fresh servers; the
            checkpoints on their data volume stay) -> running
  running   a rank's command exited non-zero, or a rank stopped polling for `timeout`
            seconds -> aborting; every rank's command exited 0 -> done
  aborting  every rank's command has stopped (SIGTERM, then SIGKILL) -> starting, attempt + 1
            (`RestartBudget` logs the cause), or failed once the N restarts are used

Every gang request carries the job's token (`Authorization: Bearer <token>`, the token file
of PARALLAX_TOKEN_FILE, mounted from the job's Secret): worker 0 answers a request without
it 401 and one naming a rank outside 0..size-1, a negative attempt or an exit code outside
0..255 with 400, so no pod of the cluster but the job's own can end, fail or restart it.

The commands get PARALLAX_RESTART_COUNT = the attempt, and resume from their last checkpoint.
A supervisor that cannot reach worker 0 for `timeout` seconds (its pod is gone) stops its
command and exits LOST_GANG_EXIT: the Job's podFailurePolicy counts only that exit and
disrupted pods toward `backoffLimit`, so Kubernetes recreates the pods as a new gang; any
other failed pod ends the Job (the gang already restarted in place and gave up).
"""
from __future__ import annotations

import hmac
import json
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable, Mapping

from parallax.env import GANG_TIMEOUT_ENV, TOKEN_FILE_ENV
from parallax.launch.restarts import Outcome, RestartBudget

GANG_TIMEOUT_S = 60.0
LOST_GANG_EXIT = 75  # EX_TEMPFAIL: this pod lost its gang; the Job may recreate the pods
PATH = "/parallax/gang"
POLL_S = 0.5
STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL
FINAL = ("done", "failed")
_INTEGER = re.compile(r"-?[0-9]{1,12}")  # ASCII digits only (str.isdigit takes "²" and "١")
MAX_EXIT_CODE = 255  # a supervisor reports a signal's death as 128 + its number
AUTH_HEADER = "Authorization"
AUTH_SCHEME = "Bearer "


class GangRequestError(ValueError):
    """A gang request that names no rank of this gang, or an attempt or code out of range."""


class GangRefused(Exception):
    """Worker 0 refused this supervisor's request (401: not the job's token; 400)."""


class Gang:
    """Worker 0's record of every rank's attempt (thread-safe). `on_start(attempt)` runs before
    an attempt opens; `step()` advances the states (call it every POLL_S)."""

    def __init__(self, size: int, budget: RestartBudget, on_start: Callable[[int], None],
                 timeout: float = GANG_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] = print):
        self.size, self.budget, self.on_start, self.say = size, budget, on_start, say
        self.timeout, self.clock = timeout, clock
        self.attempt, self.state, self.code, self.cause = 0, "starting", 0, ""
        self.seen: dict[int, float] = {}
        self.exits: dict[int, int] = {}
        self.told: set[int] = set()  # ranks that saw the final state
        self._lock = threading.Lock()

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise GangRequestError(f"rank {rank!r} is not a rank of this gang (0..{self.size - 1})")

    def poll(self, rank: int) -> dict:
        self._check_rank(rank)
        with self._lock:
            self.seen[rank] = self.clock()
            if self.state in FINAL:
                self.told.add(rank)
            return {"attempt": self.attempt, "state": self.state, "code": self.code}

    def report(self, rank: int, attempt: int, code: int) -> None:
        self._check_rank(rank)
        if attempt < 0:
            raise GangRequestError(f"attempt {attempt} must be >= 0")
        with self._lock:
            self.seen[rank] = self.clock()
            if attempt == self.attempt and self.state in ("running", "aborting"):
                self.exits.setdefault(rank, code)

    def everyone_told(self) -> bool:
        return len(self.told) == self.size

    def _lost(self) -> list[int]:
        now = self.clock()
        return [r for r in range(self.size)
                if r not in self.exits and now - self.seen.get(r, -1e18) > self.timeout]

    def step(self) -> None:
        with self._lock:
            state = self.state
            if state == "running":
                self._check_running()
            ready = state == "starting" and len(self._present()) == self.size
            ended = state == "aborting" and len(self.exits) + len(self._lost()) == self.size
        if ready:
            self._open()
        elif ended:
            self._restart_or_fail()

    def _present(self) -> list[int]:
        return [r for r in range(self.size) if r not in self._lost()]

    def _check_running(self) -> None:
        failed = {r: c for r, c in sorted(self.exits.items()) if c != 0}
        lost = self._lost()
        if failed or lost:
            rank, code = next(iter(failed.items())) if failed else (lost[0], 1)
            self.cause = (f"worker {rank}'s command exited with {code}" if failed else
                          f"worker {rank} stopped answering for {self.timeout:g} s (pod gone?)")
            self.state, self.code = "aborting", code
        elif len(self.exits) == self.size:
            self.state = "done"

    def _open(self) -> None:
        try:
            self.on_start(self.attempt)
        except Exception as err:  # noqa: BLE001 - servers unreachable etc.: the job fails
            self.cause = f"could not start attempt {self.attempt}: {err}"
            self.say(self.cause)
            self._finish("failed", 1)
            return
        with self._lock:
            self.state = "running"

    def _restart_or_fail(self) -> None:
        outcome = Outcome.failed(self.code, self.cause)
        if self.budget.should_restart(outcome):  # logs, and sleeps the restart delay
            with self._lock:
                self.attempt, self.state, self.exits = self.attempt + 1, "starting", {}
                self.code, self.cause = 0, ""
        else:
            self._finish("failed", self.code)

    def _finish(self, state: str, code: int) -> None:
        with self._lock:
            self.state, self.code = state, code


def _query_ints(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """The integer query parameters `names` of `path`; GangRequestError when one is missing,
    repeated or not a decimal integer."""
    pairs = urllib.parse.parse_qsl(urllib.parse.urlsplit(path).query, keep_blank_values=True)
    values: dict[str, int] = {}
    for name in names:
        given = [v for k, v in pairs if k == name]
        if len(given) != 1 or not _INTEGER.fullmatch(given[0]):
            raise GangRequestError(f"the query needs one integer {name}=, not {given!r}")
        values[name] = int(given[0])
    return values


def handler_class(base: type, gang: Gang, token: str | None = None) -> type:
    """`base` (Horovod's RendezvousHandler) answering also GET and PUT under PATH; with
    `token`, only requests that carry it (else 401)."""
    expected = (AUTH_SCHEME + token).encode() if token else None

    class GangHandler(base):
        def do_GET(self):  # noqa: N802 - http.server's naming
            if not self.path.startswith(PATH):
                return super().do_GET()
            self._answer(lambda q: gang.poll(q["rank"]), ("rank",))

        def do_PUT(self):  # noqa: N802
            if not self.path.startswith(PATH):
                return super().do_PUT()
            self._answer(lambda q: gang.report(q["rank"], q["attempt"], self._code(q)) or {},
                         ("rank", "attempt", "code"))

        @staticmethod
        def _code(query: dict[str, int]) -> int:
            if not 0 <= query["code"] <= MAX_EXIT_CODE:
                raise GangRequestError(f"code {query['code']} is not an exit code "
                                       f"(0..{MAX_EXIT_CODE})")
            return query["code"]

        def _answer(self, act: Callable[[dict[str, int]], dict], names: tuple[str, ...]) -> None:
            given = (self.headers.get(AUTH_HEADER) or "").encode()
            if expected is not None and not hmac.compare_digest(given, expected):
                return self._json(401, {"error": "the gang needs the job's token"})
            try:
                self._json(200, act(_query_ints(self.path, names)))
            except GangRequestError as err:
                self._json(400, {"error": str(err)})

        def _json(self, status: int, value: dict) -> None:
            body = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return GangHandler


def run_steps(gang: Gang, stop: threading.Event) -> threading.Thread:
    """Worker 0: advance `gang` every POLL_S until `stop` is set."""
    def loop() -> None:
        while not stop.wait(POLL_S):
            gang.step()
    thread = threading.Thread(target=loop, name="gang", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------------------------
# Every rank: the supervisor of its pod's command.

class Supervisor:
    """Runs `command` once per attempt that worker 0 at `url` opens; returns the exit code."""

    def __init__(self, url: str, rank: int, command: list[str],
                 child_env: Callable[[int], Mapping[str, str]], timeout: float = GANG_TIMEOUT_S,
                 token: str | None = None):
        self.url, self.rank, self.command = url.rstrip("/"), rank, command
        self.child_env, self.timeout = child_env, timeout
        self.headers = {AUTH_HEADER: AUTH_SCHEME + token} if token else {}
        self.child: subprocess.Popen | None = None
        self.signum: int | None = None

    def _call(self, method: str, **query) -> dict | None:
        text = urllib.parse.urlencode({"rank": self.rank, **query})
        request = urllib.request.Request(f"{self.url}{PATH}?{text}", method=method, data=(
            b"" if method == "PUT" else None), headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as err:
            if 400 <= err.code < 500:
                raise GangRefused(f"worker 0 refused {method} {PATH} with {err.code} "
                                  f"({err.read()[:200].decode('utf-8', 'replace')}): "
                                  f"{self._fix(err.code)}") from None
            return None
        except (OSError, ValueError):
            return None

    @staticmethod
    def _fix(status: int) -> str:
        if status == 401:
            return (f"this pod's {TOKEN_FILE_ENV} does not hold the job's token; every "
                    f"worker pod must mount the same Secret")
        return "a parallax version mismatch between the worker pods? use one image"

    def _await_open(self, after: int) -> dict | None:
        """The next attempt's status once it runs (or the final one); None: worker 0 lost."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self.signum is None:
            status = self._call("GET")
            if status is not None:
                deadline = time.monotonic() + self.timeout
                if status["state"] in FINAL or (status["state"] == "running"
                                                and status["attempt"] > after):
                    return status
            time.sleep(POLL_S)
        return None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            return self._run()
        except GangRefused as err:
            if self.child is not None:
                self._stop_child()
            print(f"parallax k8s worker {self.rank}: {err}", flush=True)
            return 1

    def _run(self) -> int:
        attempt = -1
        while True:
            status = self._await_open(attempt)
            if self.signum is not None:
                return 128 + self.signum
            if status is None:
                return self._lost()
            if status["state"] in FINAL:
                return status["code"] if status["code"] != LOST_GANG_EXIT else 1
            attempt = status["attempt"]
            code = self._attempt(attempt)
            if code is None:
                return self._lost()
            self._call("PUT", attempt=attempt, code=code)

    def _lost(self) -> int:
        print(f"parallax k8s worker {self.rank}: lost worker 0 at {self.url} for "
              f"{self.timeout:g} s; exiting {LOST_GANG_EXIT} so the Job recreates the pods "
              f"(raise {GANG_TIMEOUT_ENV} if worker 0 is only slow)", flush=True)
        return LOST_GANG_EXIT

    def _attempt(self, attempt: int) -> int | None:
        """Run the command until it exits or the gang aborts; its code (None: worker 0 lost)."""
        self.child = subprocess.Popen(self.command, env=dict(self.child_env(attempt)))
        last_contact = time.monotonic()
        while self.child.poll() is None:
            time.sleep(POLL_S)
            status = self._call("GET")
            if status is not None:
                last_contact = time.monotonic()
            if status is not None and (status["attempt"] != attempt
                                       or status["state"] != "running"):
                self._stop_child()
            elif time.monotonic() - last_contact > self.timeout:
                self._stop_child()
                return None
        code = self.child.returncode
        return code if code >= 0 else 128 - code

    def _stop_child(self) -> None:
        if self.child.poll() is not None:
            return
        self.child.terminate()
        try:
            self.child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()

    def _on_signal(self, signum, _frame) -> None:
        self.signum = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)
