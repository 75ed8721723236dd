"""The contract between the launchers and the processes they start, in one place: every
`PARALLAX_*` environment variable, the run modes, what a run id may be and how one is
made, and the line a server prints once it listens.

`parallax run`, `parallax k8s` manifests, the benchmark harness and the embedded default all
set these; workers (the strategy), servers and the tools read them. No other module spells a
name or a mode itself.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, Mapping

from parallax.errors import ConfigError

log = logging.getLogger("parallax")

# ---- what workers read -------------------------------------------------------------------
ADDRESSES_ENV = "PARALLAX_PS_ADDRESSES"  # comma-separated host:port of every server
RUN_ID_ENV = "PARALLAX_RUN_ID"           # the job's id: table names on the servers carry it
MODE_ENV = "PARALLAX_MODE"               # one of RUN_MODES, from `parallax run --mode`
SYNC_ENV = "PARALLAX_SYNC"               # one of SYNC_MODES, from `parallax run --async`
REPLICAS_ENV = "PARALLAX_REPLICAS"       # 1 or 2: copies of each shard (--replicas)
REPLAY_ENV = "PARALLAX_REPLAY_MB"        # N > 0 (--replay-mb): each worker keeps up to N MiB
#                                         of its pushes, to replay them to a server started
#                                         again from its newest checkpoint (parallax.client.replay)
RESTART_COUNT_ENV = "PARALLAX_RESTART_COUNT"  # 0, 1, ...: which attempt (--max-restarts)
RESCALE_FILE_ENV = "PARALLAX_RESCALE_FILE"  # the launcher asks the workers there to stop at
#                                         their next checkpoint (`rescale_request`,
#                                         `note_rescale_stop`): an elastic job's, for another
#                                         worker count; one whose servers keep copies, to
#                                         start a lost server again with copies of its shards
ELASTIC_ENV = "PARALLAX_ELASTIC"  # "1": an elastic job (its chief notes the global batch)
HELD_BACKUPS_ENV = "PARALLAX_HELD_BACKUPS"  # N >= 1 (--held-backups): Keras' BackupAndRestore
#                                         keeps the tables of every backup but each N-th in the
#                                         servers' memory (parallax.tf.state.held_backups)
TABLES_KEPT_ENV = "PARALLAX_TABLES_KEPT"  # "1": the launcher kept the run's tables on the
#                                         servers for this attempt (held backups): the chief
#                                         rolls them back to a held backup or drops them
RESCALE_EXIT = 75  # a worker's exit code when it stopped for a rescale (EX_TEMPFAIL)
RESCALE_AT_START = "the start"  # where workers whose count cannot split the global batch stop
TF_CONFIG_ENV = "TF_CONFIG"  # TensorFlow's cluster description (JSON), read, never written
WORKERS_ENV = "PARALLAX_WORKERS"         # without Horovod: every worker's host:port for
WORKER_RANK_ENV = "PARALLAX_WORKER_RANK"  # TensorFlow's collectives, and this one's index
COLLECTIVES = ("auto", "horovod", "tensorflow")  # ParallaxStrategy(collectives=...)
TF_HEARTBEAT_ENV = "PARALLAX_TF_HEARTBEAT_S"  # TensorFlow's collectives: seconds a silent
TF_HEARTBEAT_S = 60.0                    # (paused) worker may be before the job fails
PLAN_CACHE_ENV = "PARALLAX_PLAN_CACHE"   # where the partition search keeps its decisions
WORKER_METRICS_PORT_ENV = "PARALLAX_WORKER_METRICS_PORT"  # a worker's /metrics: 0 a free
#                                         port, P: the worker of local rank i at P+i
WORKER_METRICS_HOST_ENV = "PARALLAX_WORKER_METRICS_HOST"  # what it binds (127.0.0.1)
WORKER_METRICS_PREFIX = "PARALLAX_WORKER_METRICS"  # the stderr line a worker prints once it
#                                         serves them: rank=R address=H:P (`parallax run`)

# ---- every process parallax starts -------------------------------------------------------
LOG_LEVEL_ENV = "PARALLAX_LOG_LEVEL"     # debug|info|warning|error|critical (--log-level)
PARENT_ENV = "PARALLAX_PARENT_PID"       # the process whose death ends this one (lifeline)
TLS_CA_ENV = "PARALLAX_TLS_CA"           # with --secure: the job's CA, certificate, key and
TLS_CERT_ENV = "PARALLAX_TLS_CERT"       # token file (parallax.protocol.security)
TLS_KEY_ENV = "PARALLAX_TLS_KEY"
TOKEN_FILE_ENV = "PARALLAX_TOKEN_FILE"
CONNECT_TIMEOUT_ENV = "PARALLAX_CONNECT_TIMEOUT"  # seconds each server has to answer at the
#                                         first step (ParallaxStrategy's connect_timeout)
CONNECT_TIMEOUT_S = 60.0                 # its default (`parallax k8s --server-wait` sets more)
NATIVE_ENV = "PARALLAX_NATIVE"           # auto | 1 | 0: the compiled data path (parallax.native)
NATIVE_MODES = ("auto", "1", "0")

# ---- servers -----------------------------------------------------------------------------
METRICS_IDLE_ENV = "PARALLAX_METRICS_IDLE_S"  # seconds a /metrics connection has (default 5)
READY_PREFIX = "PARALLAX_SERVER_READY"   # a server's first stdout line: READY address=H:P

# ---- Kubernetes (parallax k8s) -------------------------------------------------------------
JOB_CONFIG_ENV = "PARALLAX_JOB_CONFIG"   # the job's job.json (its ConfigMap), in worker pods
PLAN_KEYS = ("placement", "shards", "local_aggregation", "search_partitions")  # its "plan"
RENDEZVOUS_ENV = "PARALLAX_RENDEZVOUS"   # host:port of rank 0's rendezvous server
RENDEZVOUS_TIMEOUT_ENV = "PARALLAX_RENDEZVOUS_TIMEOUT"
MAX_RESTARTS_ENV = "PARALLAX_K8S_MAX_RESTARTS"  # set by the manifests: the gang's N
GANG_TIMEOUT_ENV = "PARALLAX_GANG_TIMEOUT"       # seconds without contact that lose a rank
WARM_STARTS_ENV = "PARALLAX_WARM_STARTS"  # auto|on|off: a worker pod's `parallax k8s --warm-starts`

# ---- Horovod's, as a parallax worker starts it (parallax.tf.collectives.horovod) -------------
HOROVOD_CYCLE_TIME_ENV = "HOROVOD_CYCLE_TIME"  # ms; horovodrun --cycle-time-ms sets it
HOROVOD_AUTOTUNE_ENV = "HOROVOD_AUTOTUNE"      # > 0: Horovod tunes the cycle time itself
WORKER_CYCLE_TIME_MS = 5.0  # a worker's cycle where neither is set (Horovod's: 1 ms)

# ---- TensorFlow's, read once when its runtime starts (its thread pools' sizes) -----------
TF_THREAD_ENVS = ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")

# ---- modes and run ids -------------------------------------------------------------------
RUN_MODES = ("hybrid", "ps", "allreduce")
SYNC_MODES = ("sync", "async")
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,48}$")


def _seconds(environ: Mapping[str, str] | None, name: str, default: float) -> float:
    """Variable `name`'s seconds, 1-86400 (`default` when unset); ConfigError names a bad
    value."""
    text = (os.environ if environ is None else environ).get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1 <= value <= 86400:
        raise ConfigError(f"{name}={text!r} must be a number of seconds in 1-86400 (default "
                          f"{default:g})")
    return value


def tf_heartbeat_seconds(environ: Mapping[str, str] | None = None) -> float:
    """PARALLAX_TF_HEARTBEAT_S (default TF_HEARTBEAT_S): how long TensorFlow's coordination
    service waits for a worker's heartbeat before it fails every worker's collectives."""
    return _seconds(environ, TF_HEARTBEAT_ENV, TF_HEARTBEAT_S)


def connect_timeout(environ: Mapping[str, str] | None = None) -> float:
    """PARALLAX_CONNECT_TIMEOUT's seconds (CONNECT_TIMEOUT_S when unset): how long each server
    has to answer at the first step."""
    return _seconds(environ, CONNECT_TIMEOUT_ENV, CONNECT_TIMEOUT_S)


def worker_metrics_port(environ: Mapping[str, str] | None = None) -> int | None:
    """PARALLAX_WORKER_METRICS_PORT: None (unset or empty: no endpoint), 0 (a free port) or
    the first port of a machine's workers; ConfigError names a bad value."""
    text = (os.environ if environ is None else environ).get(WORKER_METRICS_PORT_ENV, "")
    if not text.strip():
        return None
    if not text.strip().isdigit() or int(text) > 65535:
        raise ConfigError(f"{WORKER_METRICS_PORT_ENV}={text!r} must be 0 (a free port) or a "
                          f"port in 1-65535 (the worker of local rank i listens on it + i)")
    return int(text)


def held_backups(environ: Mapping[str, str] | None = None) -> int:
    """PARALLAX_HELD_BACKUPS: 0 (unset: every backup on disk), or N >= 1: one backup in N
    on disk, the others held in the servers' memory."""
    text = (os.environ if environ is None else environ).get(HELD_BACKUPS_ENV, "").strip()
    if not text:
        return 0
    try:
        every = int(text)
    except ValueError:
        every = -1
    if every < 0:
        raise ConfigError(f"{HELD_BACKUPS_ENV}={text!r} must be a whole number >= 0 (N: one "
                          f"backup in N on disk, the others held by the servers; 0: all on "
                          f"disk)")
    return every


def worker_metrics_line(rank: int, address: str) -> str:
    """The line a worker prints once its /metrics listens (`parse_worker_metrics_line`)."""
    return f"{WORKER_METRICS_PREFIX} rank={rank} address={address}"


def parse_worker_metrics_line(line: str) -> tuple[int, str] | None:
    """(rank, host:port) of a worker's metrics line, found anywhere in `line` (horovodrun
    prefixes its workers' lines); None for any other line."""
    _, found, rest = line.partition(WORKER_METRICS_PREFIX + " ")
    fields = dict(f.split("=", 1) for f in rest.split() if "=" in f) if found else {}
    if not fields.get("rank", "").isdigit() or "address" not in fields:
        return None
    return int(fields["rank"]), fields["address"]


def ask_rescale(path: str | Path, workers: int, why: str = "") -> None:
    """The launcher's request: stop at the next checkpoint, to go on with `workers` workers
    (`why`: what for, when not for a new count; written whole, then renamed: a worker never
    reads half of it)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"workers": workers, "why": why}))
    os.replace(partial, path)


def withdraw_rescale(path: str | Path) -> None:
    """The launcher's request is void: the workers go on as they are."""
    Path(path).unlink(missing_ok=True)


def rescale_request(path: str | Path) -> int | None:
    """The worker count the launcher asked for in `path`; None when it asked nothing."""
    try:
        workers = json.loads(Path(path).read_text()).get("workers")
    except (OSError, ValueError, AttributeError):
        return None
    return workers if isinstance(workers, int) and workers > 0 else None


def rescale_reason(path: str | Path) -> str:
    """What the launcher's request in `path` is for ("" when for a new worker count)."""
    try:
        why = json.loads(Path(path).read_text()).get("why")
    except (OSError, ValueError, AttributeError):
        return ""
    return why if isinstance(why, str) else ""


def note_rescale_stop(path: str | Path, at: str) -> None:
    """The chief's answer: the workers stopped right after the checkpoint `at` ("epoch 3")."""
    Path(f"{path}.stopped").write_text(json.dumps({"at": at}))


def stopped_for_rescale(path: str | Path, clear: bool = True) -> str | None:
    """Where the workers stopped for a new count (`note_rescale_stop`'s `at`; RESCALE_AT_START:
    before their first step, as their count did not split the global batch), None when
    they did not (and, `clear`, clears the answer)."""
    answer = Path(f"{path}.stopped")
    try:
        at = json.loads(answer.read_text()).get("at")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        at = None
    if clear:
        answer.unlink(missing_ok=True)
    return at if isinstance(at, str) and at else "a checkpoint"


def note_global_batch(path: str | Path, batch: int) -> None:
    """The chief's note of its training data's global batch: the worker counts that split
    it evenly are the ones the launcher may start next (`global_batch`)."""
    partial = Path(f"{path}.batch.partial")
    partial.write_text(json.dumps({"global_batch": batch}))
    os.replace(partial, f"{path}.batch")


def global_batch(path: str | Path) -> int | None:
    """The global batch the chief noted last; None before it noted one."""
    try:
        batch = json.loads(Path(f"{path}.batch").read_text()).get("global_batch")
    except (OSError, ValueError, AttributeError):
        return None
    return batch if isinstance(batch, int) and batch > 0 else None


def is_run_id(text: str) -> bool:
    """Whether `text` may be a run id: 1-48 letters, digits, '_' or '-'."""
    return bool(_RUN_ID.fullmatch(text))  # (match's $ would take a trailing newline)


def check_run_id(run_id: str, source: str) -> str:
    if not is_run_id(run_id):
        raise ConfigError(f"{source} {run_id!r} must be 1-48 letters, digits, '_' or '-'")
    return run_id


_PLANNED_TABLE = re.compile(r"[vg]\d+(?:\.|$)")  # after "RUN.": a variable's or a group's


def split_run_id(table: str) -> tuple[str, str]:
    """(run id, table) of a server table a plan named "RUN.v3.embedding" (the variable's
    table) or "RUN.g0.x2" (a table group's): ("RUN", "v3.embedding"); ("", name) for a name
    made otherwise (a PSClient user's own). Metrics label a table with both."""
    head, dot, rest = table.partition(".")
    if dot and is_run_id(head) and _PLANNED_TABLE.match(rest):
        return head, rest
    return "", table


def new_run_id() -> str:
    """Time of day plus random hex, e.g. `1130142501-3fa2c1`."""
    return time.strftime("%m%d%H%M%S") + "-" + secrets.token_hex(3)


# ---- the plan overrides of a `parallax k8s` job ---------------------------------------------
def strategy_options(path: str | None = None) -> dict[str, Any]:
    """The plan overrides of the job's ConfigMap as ParallaxStrategy keyword arguments;
    {} outside such a pod. ParallaxStrategy applies them by itself (`plan_overrides`)."""
    path = path or os.environ.get(JOB_CONFIG_ENV)
    if not path or not Path(path).is_file():
        return {}
    try:
        plan = json.loads(Path(path).read_text()).get("plan", {})
    except (json.JSONDecodeError, AttributeError):
        raise ConfigError(f"{JOB_CONFIG_ENV}={path} is not the JSON object `parallax k8s` "
                          f"renders into its ConfigMap; fix the file or unset "
                          f"{JOB_CONFIG_ENV}") from None
    return {k: plan[k] for k in PLAN_KEYS if k in plan}


def plan_overrides(given: Mapping[str, Any]) -> dict[str, Any]:
    """What ParallaxStrategy takes from the job's ConfigMap ($PARALLAX_JOB_CONFIG): its plan
    overrides for the arguments `given` leaves None (an argument given wins); one INFO line
    names what was applied, and what the arguments overrode."""
    options = strategy_options()
    applied = {k: v for k, v in options.items() if given.get(k) is None}
    if options:
        kept = sorted(set(options) - set(applied))
        log.info("plan overrides from %s=%s: %s%s", JOB_CONFIG_ENV, os.environ[JOB_CONFIG_ENV],
                 ", ".join(f"{k}={v!r}" for k, v in applied.items()) or "none applied",
                 f" (ParallaxStrategy's own {', '.join(kept)} kept)" if kept else "")
    return applied
