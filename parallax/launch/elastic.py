"""Elastic worker counts for `parallax run`: `--host-discovery-script`, `--min-np`, `--max-np`
and `--elastic-timeout`, Horovod Elastic's flags.

The script prints the hosts workers may run on now, one `host:N` (N slots) or `host` line
each, as Horovod's does. Every attempt of the job runs `min(slots listed, --max-np)` workers
(`Elastic.workers`), once at least `--min-np` slots are listed (`Elastic.wait`: up to
`--elastic-timeout` seconds, Horovod's 600 by default). The servers are not on those hosts:
they are this launcher's (`--servers`) or external (`--ps-addresses`). The hosts must be
this machine for now (`localhost:N`): the request below is a file here.

While an attempt runs, the script runs every DISCOVERY_PERIOD_S (`RescaleWatch`). When the
count it allows differs from the attempt's, or a host the attempt uses is no longer listed,
the launcher asks the workers to stop at their next checkpoint (`parallax.env.ask_rescale`,
the file named by PARALLAX_RESCALE_FILE; withdrawn when the count comes back before they
stopped). They stop right after it
(`parallax.tf.state.rescale`; Keras `fit`: the end of an epoch that saved one), and the next
attempt starts with the new count, resuming from that checkpoint: nothing is redone, and the
stop uses none of `--max-restarts`. A worker that fails is restarted as before
(`--max-restarts`), with the count listed then. Each worker's part of a step is the global
batch over the worker count (`parallax.tf.strategy.datasets`), so the job trains as one
with a fixed worker count would, on the same global batches.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from parallax.env import ask_rescale, global_batch, withdraw_rescale
from parallax.errors import ConfigError, ParallaxError
from parallax.launch.hosts import ClusterLayout, is_local, parse_discovered, worker_hosts

DISCOVERY_PERIOD_S = 1.0     # how often a running job's hosts are discovered again
DISCOVERY_TIMEOUT_S = 30.0   # the most one run of the script may take
ELASTIC_TIMEOUT_S = 600.0    # default --elastic-timeout: waiting for --min-np slots


class Elastic:
    """The discovery script and the bounds on the worker count."""

    def __init__(self, script: str, min_np: int, max_np: int,
                 timeout_s: float = ELASTIC_TIMEOUT_S, say: Callable[[str], None] = print) -> None:
        if not 1 <= min_np <= max_np:
            raise ConfigError(f"--min-np {min_np} and --max-np {max_np}: need 1 <= --min-np "
                              f"<= --max-np (-np is --max-np's default)")
        if not timeout_s > 0:  # (nan too)
            raise ConfigError(f"--elastic-timeout {timeout_s:g} must be > 0 seconds")
        self.script, self.min_np, self.max_np = script, min_np, max_np
        self.timeout_s, self.say = timeout_s, say
        self.request: Path | None = None  # where the launcher asks for a count (and the
        #                                   chief notes its global batch): parallax.env
        self._failed = ""  # the kind of the script's last failure, said once
        self._split = ""  # the last count lowered to split the global batch, said once
        self._lock = threading.Lock()
        self._running: subprocess.Popen | None = None  # the script, while it runs

    def discover(self, cancelled: threading.Event | None = None) -> ClusterLayout | None:
        """The hosts listed now; None (said once) when the script fails or says nonsense, and
        None (unsaid) when `cancelled` was set meanwhile (`cancel` ended the script)."""
        try:
            code, out, err = self._run(cancelled)
            if cancelled is not None and cancelled.is_set():
                return None
            if code:
                raise ParallaxError(f"exited with code {code}: "
                                    f"{err.strip()[-300:] or '(no output)'}")
            layout = parse_discovered(out, "its output")
        except (OSError, subprocess.TimeoutExpired, ParallaxError) as exc:
            self.say_once(f"--host-discovery-script {self.script!r}: {exc}")
            return None
        _check_local(self.script, layout)  # (a refusal, said once by the watch)
        self._failed = ""
        return layout

    def _run(self, cancelled: threading.Event | None) -> tuple[int, str, str]:
        """The script's exit code, output and error output. It runs in a process group of
        its own, all of which is killed when it runs past DISCOVERY_TIMEOUT_S, when the
        launcher is interrupted meanwhile (SIGINT/SIGTERM) and on `cancel`: what the shell
        started ends with it."""
        proc = subprocess.Popen(self.script, shell=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        with self._lock:
            self._running = proc
        try:
            if cancelled is not None and cancelled.is_set():  # before `cancel` saw it
                _end_group(proc)
            out, err = proc.communicate(timeout=DISCOVERY_TIMEOUT_S)
        except BaseException:
            _end_group(proc)
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            raise
        finally:
            with self._lock:
                self._running = None
        return proc.returncode, out, err

    def cancel(self) -> None:
        """End the script that runs now, if one does (from another thread than its)."""
        with self._lock:
            if self._running is not None:
                _end_group(self._running)

    def say_once(self, message: str) -> None:
        """Say a failure of discovery, unless it is the one said last (numbers aside: a
        script's error often names the time, as kubectl's do)."""
        kind = re.sub(r"\d+", "#", message)
        if kind != self._failed:
            self._failed = kind
            self.say(message)

    def workers(self, layout: ClusterLayout | None) -> int:
        """Workers for `layout`: the most, up to min(its slots, --max-np), that split the
        global batch the chief noted evenly (`request`; any count before it noted one);
        0 below --min-np."""
        most = min(layout.num_slots if layout is not None else 0, self.max_np)
        batch = self._batch()
        count = next((n for n in range(most, 0, -1) if not batch or batch % n == 0), 0)
        said = f"{most} worker(s) would not split the global batch of {batch} evenly: " \
               f"running {count}"
        if count < most and count >= self.min_np and said != self._split:
            self._split = said  # (said once, not at every discovery)
            self.say(said)
        return count if count >= self.min_np else 0

    def _batch(self) -> int | None:
        """The global batch the chief noted (None before, or outside `parallax run`)."""
        return global_batch(self.request) if self.request is not None else None

    def wait(self, interrupted: Callable[[], bool] = lambda: False) -> tuple[ClusterLayout, int]:
        """The layout and worker count of the next attempt, once --min-np slots are listed;
        ParallaxError after --elastic-timeout seconds without."""
        deadline, said = time.monotonic() + self.timeout_s, False
        while True:
            layout = self.discover()
            count = self.workers(layout)
            if count:
                return layout, count
            if interrupted() or time.monotonic() > deadline:
                batch = self._batch()
                raise ParallaxError(f"--host-discovery-script listed {_slots(layout)} for "
                                    f"{self.timeout_s:g}s (--elastic-timeout); --min-np "
                                    f"{self.min_np} needs {self.min_np}"
                                    + (f", and a count that splits the global batch of "
                                       f"{batch} evenly" if batch else ""))
            if not said:
                said = True
                self.say(f"waiting up to {self.timeout_s:g}s for --min-np {self.min_np} "
                          f"slots; the host discovery script lists {_slots(layout)}")
            time.sleep(DISCOVERY_PERIOD_S)


def _end_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # all of it ended


def _check_local(script: str, layout: ClusterLayout) -> None:
    remote = [h.host for h in layout.hosts if not is_local(h.host)]
    if remote:
        raise ConfigError(f"--host-discovery-script {script!r} lists {', '.join(remote)}: an "
                          f"elastic job's workers run on this machine for now (the request "
                          f"to stop for a new count is a file here); list this machine's "
                          f"slots (localhost:N)")


def _slots(layout: ClusterLayout | None) -> str:
    return "no hosts" if layout is None else f"{layout.num_slots} slot(s)"


class RescaleWatch:
    """While an attempt runs: discovers the hosts every DISCOVERY_PERIOD_S and asks the
    workers (`ask_rescale` into `path`) to stop at their next checkpoint when another worker
    count is called for, and withdraws the request (`withdraw_rescale`) when the attempt's
    own count is back first; `asked` is the count asked (None: none). The launcher's own
    request (`stop_anyway`: a lost server to start again) shares the file, and no
    withdrawal of a count ends it."""

    def __init__(self, elastic: Elastic, layout: ClusterLayout, workers: int,
                 path: Path) -> None:
        self.elastic, self.workers, self.path = elastic, workers, path
        self._using = {h.host for h, _, _ in worker_hosts(layout, workers)}
        self.asked: int | None = None
        self.why = ""  # the launcher's own reason to stop ("": none)
        self._writing = threading.Lock()  # the file's two writers: this thread, the launcher
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="parallax-discovery",
                                        daemon=True)

    def start(self) -> "RescaleWatch":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(DISCOVERY_PERIOD_S):
            try:
                layout = self.elastic.discover(self._stop)
            except ConfigError as exc:  # the hosts of the running attempt stay
                layout = None
                self.elastic.say_once(str(exc))
            if self._stop.is_set():
                return
            if layout is None:
                continue  # a failing script changes nothing (said once)
            wanted = self.elastic.workers(layout)
            gone = self._using - {h.host for h in layout.hosts}
            if wanted and (wanted != self.workers or gone) and wanted != self.asked:
                with self._writing:
                    self.asked = wanted
                    ask_rescale(self.path, wanted, self.why)
                self.elastic.say(
                    f"the host discovery script lists {layout.num_slots} slot(s)"
                    + (f" (no longer {', '.join(sorted(gone))})" if gone else "")
                    + f": asking the {self.workers} worker(s) to stop at their next "
                    f"checkpoint, to go on with {wanted}")
            elif wanted == self.workers and not gone and self.asked is not None:
                self._withdraw(layout)

    def _withdraw(self, layout: ClusterLayout) -> None:
        """The attempt's own count is back before the workers' checkpoint: they go on as
        they are, or stop there all the same for the launcher's own request."""
        with self._writing:
            self.asked = None
            if self.why:
                ask_rescale(self.path, self.workers, self.why)
            else:
                withdraw_rescale(self.path)
        self.elastic.say(
            f"the host discovery script lists {layout.num_slots} slot(s) again: the "
            f"{self.workers} worker(s) go on"
            + (f"; they still stop at their next checkpoint, to go on from it with "
               f"{self.why}" if self.why else "; the request to stop is withdrawn"))

    def stop_anyway(self, why: str) -> None:
        """The launcher's own request: stop at the next checkpoint for `why`, with the count
        asked meanwhile, if any (else this one)."""
        with self._writing:
            self.why = why
            ask_rescale(self.path, self.asked or self.workers, why)

    def stop(self) -> None:
        """Stop watching (the attempt ended, or never got to start its workers)."""
        self._stop.set()
        self.elastic.cancel()  # a script that hangs now would hold the launcher up
        if self._thread.is_alive():
            self._thread.join(DISCOVERY_TIMEOUT_S + 1)
