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

An elastic gang (`parallax k8s --min-np A --max-np B`, `Scaling`) admits the pods of indexes
0..B-1, and each attempt runs the ranks that checked in then (`members`, at least A, worker
0 first; their Horovod ranks are their places in it): a pod that comes (the Job scaled up)
or announces that it leaves (`/parallax/gang/leave`: its supervisor got SIGTERM, the Job
scaled down) makes worker 0 ask the running commands to stop right after their next
checkpoint (`parallax.env.ask_rescale` into the rescale file of worker 0's command, the
chief's; `parallax.tf.state.rescale`), and the next attempt goes on from it with the new
count. Such a stop, and a failure caused by a rank that announced its leaving, use none of
the restarts.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from parallax.env import (GANG_TIMEOUT_ENV, TOKEN_FILE_ENV, ask_rescale, global_batch,
                          stopped_for_rescale, withdraw_rescale)
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
LEAVE_PATH = PATH + "/leave"  # PUT ?rank=N: this rank's pod is going (a scale-down)
MIN_WORKERS_ENV = "PARALLAX_MIN_WORKERS"  # an elastic worker Job's bounds (--min-np,
MAX_WORKERS_ENV = "PARALLAX_MAX_WORKERS"  # --max-np); both unset: not elastic
ELASTIC_TIMEOUT_ENV = "PARALLAX_ELASTIC_TIMEOUT"  # seconds to wait for --min-np pods
LEAVE_GRACE_ENV = "PARALLAX_LEAVE_GRACE_S"  # seconds a leaving pod's command may take to stop
ELASTIC_TIMEOUT_S = 600.0  # default --elastic-timeout, as `parallax run`'s
SETTLE_S = 2.0     # an elastic gang opens an attempt once no pod came for this long
FRESH_S = 5.0      # a pod that polled this recently is there (supervisors poll every POLL_S)
LEAVE_QUIET_S = 2.0  # a poll this long after a rank's leave is a new pod of that index
LEAVE_GRACE_S = 15.0  # + STOP_GRACE_S: below Kubernetes' default terminationGracePeriodSeconds (30)


class GangRequestError(ValueError):
    """A gang request that names no rank of this gang, or an attempt or code out of range."""


class GangRefused(Exception):
    """Worker 0 refused this supervisor's request (401: not the job's token; 400)."""


@dataclass(frozen=True)
class Scaling:
    """An elastic gang's bounds: every attempt runs at least `min_size` ranks (waiting up to
    `timeout` seconds for them), and stops at a checkpoint for another count through
    `request`, the rescale file of worker 0's command (PARALLAX_RESCALE_FILE; its chief
    reads it, and notes there the global batch, which the count must split)."""

    min_size: int
    request: Path
    timeout: float = ELASTIC_TIMEOUT_S
    settle: float = SETTLE_S


class Gang:
    """Worker 0's record of every rank's attempt (thread-safe). `on_start(attempt)` runs before
    an attempt opens (what it returns true: the servers kept the run's tables); `step()`
    advances the states (call it every POLL_S). `size`: the ranks admitted (0..size-1); an
    attempt runs `members`, all of them unless `scaling` makes the gang elastic."""

    def __init__(self, size: int, budget: RestartBudget, on_start: Callable[[int], object],
                 timeout: float = GANG_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] = print, scaling: Scaling | None = None):
        self.size, self.budget, self.on_start, self.say = size, budget, on_start, say
        self.timeout, self.clock, self.scaling = timeout, clock, scaling
        self.attempt, self.state, self.code, self.cause = 0, "starting", 0, ""
        self.members: list[int] = list(range(size))  # this attempt's ranks, in Horovod order
        self.kept = False  # on_start said the servers kept the run's tables
        self.seen: dict[int, float] = {}
        self.exits: dict[int, int] = {}
        self.told: set[int] = set()  # ranks that saw the final state
        self.leaving: dict[int, float] = {}  # rank -> when it announced it leaves
        self.asked: int | None = None  # the count the running attempt was asked to stop for
        self.since = clock()  # when the gang began waiting for this attempt's ranks
        self._arrivals = (frozenset(), self.since)  # the ranks there, and since when
        self._lock = threading.Lock()

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise GangRequestError(f"rank {rank!r} is not a rank of this gang (0..{self.size - 1})")

    def poll(self, rank: int) -> dict:
        self._check_rank(rank)
        with self._lock:
            now = self.clock()
            self.seen[rank] = now
            if now - self.leaving.get(rank, now) > LEAVE_QUIET_S:
                del self.leaving[rank]  # a new pod of that index (the Job scaled up again)
            if self.state in FINAL:
                self.told.add(rank)
            status = {"attempt": self.attempt, "state": self.state, "code": self.code}
            if self.scaling is not None:  # (which rank of how many, per attempt)
                status.update(rank=self.members.index(rank) if rank in self.members else -1,
                              size=len(self.members), kept=self.kept)
            return status

    def leave(self, rank: int) -> dict:
        """`rank`'s pod is going (its supervisor got SIGTERM: the Job scaled down)."""
        self._check_rank(rank)
        with self._lock:
            self.leaving[rank] = self.clock()
        self.say(f"worker {rank}'s pod is leaving (SIGTERM: the Job scaled down?)")
        return {}

    def report(self, rank: int, attempt: int, code: int) -> None:
        self._check_rank(rank)
        if attempt < 0:
            raise GangRequestError(f"attempt {attempt} must be >= 0")
        with self._lock:
            self.seen[rank] = self.clock()
            if attempt == self.attempt and self.state in ("running", "aborting"):
                self.exits.setdefault(rank, code)

    def everyone_told(self) -> bool:
        """Whether the attempt's ranks, and any other pod polling now, saw the final state
        (a pod that came too late for the last attempt must end with the job, not find
        worker 0 gone)."""
        with self._lock:
            there = self._there() if self.scaling is not None else frozenset()
        return set(self.members) | there <= self.told

    def _lost(self) -> list[int]:
        now = self.clock()
        return [r for r in self.members
                if r not in self.exits and now - self.seen.get(r, -1e18) > self.timeout]

    def step(self) -> None:
        with self._lock:
            state = self.state
            if state == "running":
                self._check_running()
            ready = state == "starting" and self._ready()
            ended = state == "aborting" and \
                len(self.exits) + len(self._lost()) == len(self.members)
        if ready:
            self._open()
        elif ended:
            self._restart_or_fail()

    def _ready(self) -> bool:
        """Whether the next attempt may open (setting its `members`): an elastic gang opens
        it with the ranks there once none came for `scaling.settle` seconds, at once when
        they are the most it admits or the count it stopped the last attempt for; it fails
        after `scaling.timeout` seconds without `min_size` ranks."""
        if self.scaling is None:
            return len(self.members) == self.size and not self._lost()
        there, now = self._there(), self.clock()
        if there != self._arrivals[0]:
            self._arrivals = (there, now)
        count = self._count(there)
        settled = count in (self.size, self.asked) or \
            now - self._arrivals[1] >= self.scaling.settle  # (the count asked for is there)
        if count >= self.scaling.min_size and settled:
            self.members = sorted(there)[:count]
            return True
        unsplit = self._unsplit()
        if unsplit:
            self.cause = unsplit
            self.say(self.cause)
            self.state, self.code = "failed", 1
        elif now - self.since > self.scaling.timeout:
            least = self.scaling.min_size
            split = "" if len(there) < least or 0 not in there else (
                f", but only {count} of them split the global batch "
                f"{global_batch(self.scaling.request)} the chief noted")
            self.cause = (f"{len(there)} worker pod(s) came within --elastic-timeout "
                          f"{self.scaling.timeout:g} s{split}; --min-np {least} needs {least}"
                          + ("" if 0 in there else ", worker 0 among them"))
            self.say(self.cause)
            self.state, self.code = "failed", 1
        return False

    def _unsplit(self) -> str:
        """Why no attempt can ever run ("" if one can): no worker count from --min-np to
        --max-np splits the global batch the chief noted."""
        batch = global_batch(self.scaling.request)
        least = self.scaling.min_size
        if not batch or any(batch % n == 0 for n in range(least, self.size + 1)):
            return ""
        return (f"no worker count from --min-np {least} to --max-np {self.size} splits the "
                f"global batch {batch} the chief noted (each step consumes it whole, over "
                f"the workers): render the job with bounds that include a divisor of it")

    def _there(self) -> frozenset[int]:
        """The ranks whose supervisors poll now and do not leave."""
        now = self.clock()
        return frozenset(r for r, t in self.seen.items()
                         if now - t <= FRESH_S and r not in self.leaving)

    def _count(self, there: frozenset[int]) -> int:
        """The ranks an attempt would run: the most of `there` that split the global batch
        the chief noted (any count before it noted one); 0 without worker 0, which serves
        the rendezvous and runs the chief."""
        if 0 not in there:
            return 0
        batch = global_batch(self.scaling.request)
        return next((n for n in range(len(there), 0, -1) if not batch or batch % n == 0), 0)

    def _check_running(self) -> None:
        failed = {r: c for r, c in sorted(self.exits.items()) if c != 0}
        lost = self._lost()
        if failed or lost:
            rank, code = next(iter(failed.items())) if failed else (lost[0], 1)
            self.cause = (f"worker {rank}'s command exited with {code}" if failed else
                          f"worker {rank} stopped answering for {self.timeout:g} s (pod gone?)")
            going = sorted(set(self.members) & set(self.leaving))
            if going:  # (its command's end fails the others' collectives first, often)
                self.cause += f", worker {going[0]}'s pod having announced it leaves"
            self.state, self.code = "aborting", code
        elif len(self.exits) == len(self.members):
            self.state = "done"
        elif self.scaling is not None:
            self._ask_if_scaled()

    def _ask_if_scaled(self) -> None:
        """A pod came or is leaving: ask the running commands to stop at their next
        checkpoint, to go on with the ranks there then (asked once per count)."""
        there = self._there() | {r for r in self.members if r not in self.leaving}
        wanted = self._count(there)
        if wanted == len(self.members) and not set(self.members) & set(self.leaving):
            if self.asked is not None:  # (the pod that came left again before the stop)
                withdraw_rescale(self.scaling.request)
                self.asked = None
                self.say(f"attempt {self.attempt}: the {wanted} running are the pods there "
                         f"again: the stop asked for is withdrawn")
            return
        if wanted == self.asked:
            return
        self.asked = wanted
        ask_rescale(self.scaling.request, max(wanted, 1))
        self.say(f"attempt {self.attempt}: {len(there)} worker pod(s) there now: asking the "
                 f"{len(self.members)} running to stop after their next checkpoint, to go on "
                 f"with {wanted}")

    def _open(self) -> None:
        if self.scaling is not None:
            withdraw_rescale(self.scaling.request)
            stopped_for_rescale(self.scaling.request, clear=True)
            self.say(f"attempt {self.attempt}: {len(self.members)} worker(s), pods "
                     f"{', '.join(map(str, self.members))}")
        try:
            kept = self.on_start(self.attempt)
        except Exception as err:  # noqa: BLE001 - servers unreachable etc.: the job fails
            self.cause = f"could not start attempt {self.attempt}: {err}"
            self.say(self.cause)
            self._finish("failed", 1)
            return
        with self._lock:
            self.kept, self.asked, self.state = bool(kept), None, "running"

    def _restart_or_fail(self) -> None:
        why = self._uncounted()
        if why:
            self.say(f"attempt {self.attempt} ended: {why}; the next starts from the last "
                     f"checkpoint, using none of the restarts")
        elif not self.budget.should_restart(Outcome.failed(self.code, self.cause)):
            self._finish("failed", self.code)  # (should_restart logs, and sleeps the delay)
            return
        with self._lock:
            self.attempt, self.state, self.exits = self.attempt + 1, "starting", {}
            self.code, self.cause, self.since = 0, "", self.clock()

    def _uncounted(self) -> str:
        """Why the attempt that ended is no failure ("": it is): its commands stopped at a
        checkpoint for a new count, or a rank that announced its leaving ended it."""
        if self.scaling is None:
            return ""
        if stopped_for_rescale(self.scaling.request, clear=True) is not None:
            return "the workers stopped after their checkpoint, as asked"
        return self.cause if "announced it leaves" in self.cause else ""

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
            if urllib.parse.urlsplit(self.path).path == LEAVE_PATH:
                return self._answer(lambda q: gang.leave(q["rank"]), ("rank",))
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
    """Runs `command` once per attempt that worker 0 at `url` opens (and makes this rank a
    member of: an elastic gang's may not); returns the exit code. `child_env(status)`: the
    command's environment for the attempt whose status worker 0 answered. `leave_grace`
    (an elastic gang's pods): SIGTERM is a scale-down, told to worker 0, and the command
    gets that many seconds to stop at its checkpoint before it is stopped; the pod then
    ends with 0, not as a failure."""

    def __init__(self, url: str, rank: int, command: list[str],
                 child_env: Callable[[dict], Mapping[str, str]], timeout: float = GANG_TIMEOUT_S,
                 token: str | None = None, leave_grace: float | None = None):
        self.url, self.rank, self.command = url.rstrip("/"), rank, command
        self.child_env, self.timeout, self.leave_grace = child_env, timeout, leave_grace
        self.headers = {AUTH_HEADER: AUTH_SCHEME + token} if token else {}
        self.child: subprocess.Popen | None = None
        self.signum: int | None = None

    def _call(self, method: str, path: str = PATH, **query) -> dict | None:
        text = urllib.parse.urlencode({"rank": self.rank, **query})
        request = urllib.request.Request(f"{self.url}{path}?{text}", method=method, data=(
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
                                                and status["attempt"] > after
                                                and status.get("rank", 0) >= 0):
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
                return self._leave() if self._leaving() else 128 + self.signum
            if status is None:
                return self._lost()
            if status["state"] in FINAL:
                return status["code"] if status["code"] != LOST_GANG_EXIT else 1
            attempt = status["attempt"]
            code = self._attempt(status)
            if code is None:
                return self._lost()
            self._call("PUT", attempt=attempt, code=code)
            if self._leaving():
                return 0  # (worker 0 was told, before the command stopped)

    def _leaving(self) -> bool:
        """Whether SIGTERM came to an elastic gang's pod: the Job scaled it away."""
        return self.leave_grace is not None and self.signum == signal.SIGTERM

    def _leave(self) -> int:
        """Tell worker 0 this pod is going (so the others stop at their next checkpoint, or,
        should its command die first, restart from the last one without counting a
        failure); exits 0: a pod deleted by a scale-down did not fail. Asked again until
        worker 0 answers, for half the leave grace (it may be briefly unreachable)."""
        deadline = time.monotonic() + self.leave_grace / 2
        answered = self._call("PUT", LEAVE_PATH) is not None
        while not answered and time.monotonic() < deadline:
            time.sleep(POLL_S)
            answered = self._call("PUT", LEAVE_PATH) is not None
        told = "worker 0 was told" if answered else (
            f"worker 0 did not answer for {self.leave_grace / 2:g} s: the others' next "
            f"collective fails, and the gang restarts from the last checkpoint")
        print(f"parallax k8s worker {self.rank}: SIGTERM: leaving the gang (the Job scaled "
              f"down?); {told}", flush=True)
        return 0

    def _lost(self) -> int:
        print(f"parallax k8s worker {self.rank}: lost worker 0 at {self.url} for "
              f"{self.timeout:g} s; exiting {LOST_GANG_EXIT} so the Job recreates the pods "
              f"(raise {GANG_TIMEOUT_ENV} if worker 0 is only slow)", flush=True)
        return LOST_GANG_EXIT

    def _attempt(self, status: dict) -> int | None:
        """Run the command until it exits or the gang aborts; its code (None: worker 0 lost)."""
        attempt = status["attempt"]
        self.child = subprocess.Popen(self.command, env=dict(self.child_env(status)))
        last_contact = time.monotonic()
        while self.child.poll() is None:
            time.sleep(POLL_S)
            if self._leaving():
                return self._let_go()
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

    def _let_go(self) -> int:
        """This pod leaves while its command runs: worker 0 asks every rank's command to stop
        at their next checkpoint; this one gets `leave_grace` seconds for it."""
        self._leave()
        try:
            self.child.wait(self.leave_grace)
        except subprocess.TimeoutExpired:
            print(f"parallax k8s worker {self.rank}: the command did not reach a checkpoint "
                  f"within {self.leave_grace:g} s ({LEAVE_GRACE_ENV}); stopping it: the gang "
                  f"goes on from the last checkpoint", flush=True)
            self._stop_child()
        code = self.child.returncode
        return code if code >= 0 else 128 - code

    def _on_signal(self, signum, _frame) -> None:
        self.signum = signum
        if self._leaving():
            return  # (the command stops at its checkpoint, asked through worker 0)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)
