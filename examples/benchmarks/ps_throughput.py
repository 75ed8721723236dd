"""Pull and push throughput of ONE parameter-server process, against memcpy and raw gRPC.

What it measures
    For each row width (--dims), request size in unique ids (--ids) and shard count
    (--shards, every shard hosted on the same single server process), and for each client
    configuration (--channels x --chunk-mb):

    * pull_unique  ShardedTable.pull_unique(ids): the raw path, ids already unique.
    * pull         ShardedTable.pull(ids): the same ids through the deduping path
                   (np.unique + gather back into the caller's order).
    * push         ShardedTable.push(ids, grads): async SGD table, so every push is applied
                   on arrival (decode, validate, sum duplicates, gather-update-scatter).

    Throughput is rows/s and MB/s of row data (rows * dim * 4 bytes, 1 MB = 10**6 bytes),
    from the median wall time of several repetitions after a warm-up. The reference is this
    process's memcpy bandwidth (np.copyto of an array of the same byte size), and
    ratio = measured MB/s / memcpy MB/s. The second reference is plain Python gRPC moving the
    same bytes in the same chunks and channels between two processes (grpc_echo.py): the
    ceiling for any gRPC parameter server in Python, reported as echo MB/s and echo ratio.
    Client and server share this machine's cores; both reuse freed buffers
    (parallax.runtime.malloc_tuning), as `parallax server` does.

    Tables are fixed-vocabulary (--vocab rows, zeros initializer, float32) and created and
    deleted as the benchmark goes, so only one lives on the server at a time
    (1M rows x 256 x 4 B = 1 GiB).

How to run
    .venv/bin/python examples/benchmarks/ps_throughput.py            # full, < ~5 min
    .venv/bin/python examples/benchmarks/ps_throughput.py --quick    # < 60 s
    .venv/bin/python examples/benchmarks/ps_throughput.py --dims 256 --ids 65536 \\
        --shards 1,4 --channels 1,2,4 --chunk-mb 2,4,16

    Prints an aligned table and writes JSON (default bench-results/ps_throughput.json).
    Machine info, the code version and the load average are recorded in the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import grpc
import numpy as np
import parallax
from google.protobuf import __version__ as protobuf_version
from google.protobuf.internal import api_implementation

from parallax.client import ClientOptions, PSClient, ShardedTable
from parallax import native
from parallax.client.local_cluster import LocalCluster
from parallax.env import NATIVE_ENV
from parallax.errors import ParallaxError
from parallax.protocol.specs import SGD, TableSpec
from parallax.runtime.malloc_tuning import reuse_freed_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpc_echo import EchoClient  # noqa: E402

MALLOC_REUSE = reuse_freed_memory()  # the client reuses freed buffers, as the server does

OPS = ("pull_unique", "pull", "push")
_PUSH_STEPS = itertools.count()
MIN_REPS = 3          # a configuration always gets at least this many timed repetitions
MB = 1e6


@dataclass(frozen=True)
class Settings:
    dims: tuple[int, ...] = (64, 256)
    ids: tuple[int, ...] = (4096, 16384, 65536, 262144)
    shards: tuple[int, ...] = (1, 2, 4)
    ops: tuple[str, ...] = OPS
    channels: tuple[int, ...] = (ClientOptions.channels_per_server,)
    chunk_mb: tuple[int, ...] = (ClientOptions.chunk_mb,)
    vocab: int = 1_000_000
    reps: int = 5
    warmup: int = 1
    budget_s: float = 2.0   # per configuration: stop repeating (after MIN_REPS) past this
    seed: int = 0
    out: str = "bench-results/ps_throughput.json"
    paths: tuple[str, ...] = ("",)  # PARALLAX_NATIVE of the server, each in turn ("": as set)


QUICK = Settings(ids=(16384, 65536), shards=(1, 4), reps=3, budget_s=0.5)


@dataclass(frozen=True)
class Result:
    op: str
    dim: int
    ids: int
    shards: int
    channels: int
    chunk_mb: int
    reps: int
    median_s: float
    rows_per_s: float
    mb_per_s: float
    memcpy_mb_per_s: float
    ratio: float
    echo_mb_per_s: float
    echo_ratio: float
    error: str | None = None
    path: str = ""  # the server's data path (parallax.native.describe())


# ---- measurement -------------------------------------------------------------------------

def time_calls(fn: Callable[[], object], warmup: int, reps: int, budget_s: float) -> list[float]:
    """Wall times of `reps` calls after `warmup` untimed ones; stops early (after MIN_REPS)
    once `budget_s` is spent."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max(reps, 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= min(reps, MIN_REPS) and time.perf_counter() - start > budget_s:
            break
    return times


_MEMCPY: dict[int, float] = {}
_ECHO: dict[tuple[str, int, int, int], float] = {}
_ECHO_CLIENTS: dict[int, EchoClient] = {}


def echo_mb_per_s(direction: str, nbytes: int, options: ClientOptions) -> float:
    """Raw gRPC bytes moved the same way (cached per direction, size, chunk, channels)."""
    key = (direction, nbytes, options.chunk_bytes, options.channels_per_server)
    if key not in _ECHO:
        channels = options.channels_per_server
        if channels not in _ECHO_CLIENTS:
            _ECHO_CLIENTS[channels] = EchoClient(channels)
        _ECHO[key] = _ECHO_CLIENTS[channels].mb_per_s(direction, nbytes, options.chunk_bytes)
    return _ECHO[key]


def memcpy_mb_per_s(nbytes: int) -> float:
    """This process's np.copyto bandwidth for `nbytes` (median of 5, cached by size)."""
    if nbytes not in _MEMCPY:
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        times = time_calls(lambda: np.copyto(dst, src), warmup=1, reps=5, budget_s=1.0)
        _MEMCPY[nbytes] = nbytes / statistics.median(times) / MB
    return _MEMCPY[nbytes]


def op_call(table: ShardedTable, op: str, ids: np.ndarray,
            grads: np.ndarray) -> Callable[[], object]:
    """A zero-argument callable performing one request of `op`."""
    if op == "pull_unique":
        return lambda: table.pull_unique(ids)
    if op == "pull":
        return lambda: table.pull(ids)
    if op == "push":  # async: every push of this client's session needs a step of its own
        return lambda: table.push(ids, grads, step=next(_PUSH_STEPS), worker=0)
    raise ValueError(f"unknown op {op!r}; use one of {OPS}")


def measure(table: ShardedTable, op: str, ids: np.ndarray, grads: np.ndarray,
            client: ClientOptions, settings: Settings) -> Result:
    dim = table.spec.dim
    nbytes = len(ids) * dim * 4
    base = dict(op=op, dim=dim, ids=len(ids), shards=table.spec.shard_count,
                channels=client.channels_per_server, chunk_mb=client.chunk_mb)
    reference = memcpy_mb_per_s(nbytes)
    echo = echo_mb_per_s("put" if op == "push" else "get", nbytes, client)
    try:
        times = time_calls(op_call(table, op, ids, grads), settings.warmup, settings.reps,
                           settings.budget_s)
    except (ParallaxError, grpc.RpcError) as exc:
        message = str(exc).splitlines()[0][:200]
        return Result(**base, reps=0, median_s=float("nan"), rows_per_s=float("nan"),
                      mb_per_s=float("nan"), memcpy_mb_per_s=reference, ratio=float("nan"),
                      echo_mb_per_s=echo, echo_ratio=float("nan"), error=message)
    median = statistics.median(times)
    mb_per_s = nbytes / median / MB
    return Result(**base, reps=len(times), median_s=median, rows_per_s=len(ids) / median,
                  mb_per_s=mb_per_s, memcpy_mb_per_s=reference, ratio=mb_per_s / reference,
                  echo_mb_per_s=echo, echo_ratio=mb_per_s / echo)


# ---- orchestration -----------------------------------------------------------------------

def table_spec(dim: int, shards: int, vocab: int) -> TableSpec:
    return TableSpec(name=f"bench_d{dim}_s{shards}", dim=dim, vocabulary_size=vocab,
                     shard_count=shards, sync_mode="async", num_workers=1,
                     optimizer=SGD(learning_rate=1e-3))


def request_data(rng: np.random.Generator, vocab: int, n: int, dim: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """`n` distinct random ids (random order) and small finite gradients for them."""
    ids = rng.choice(vocab, size=n, replace=False).astype(np.int64)
    grads = rng.standard_normal((n, dim), dtype=np.float32) * np.float32(1e-3)
    return ids, grads


def run_table(clients: Sequence[PSClient], dim: int, shards: int, settings: Settings,
              rng: np.random.Generator, report: Callable[[Result], None]) -> None:
    """Create one table, run every (ids, op, client) configuration on it, delete it."""
    spec = table_spec(dim, shards, settings.vocab)
    placement = [0] * shards
    created = clients[0].create_table(spec, placement=placement)
    try:
        for n in settings.ids:
            ids, grads = request_data(rng, settings.vocab, n, dim)
            for op in settings.ops:
                for client in clients:
                    table = client.table(spec, placement=placement)
                    report(measure(table, op, ids, grads, client.options, settings))
    finally:
        clients[0].delete_table(created)


@contextlib.contextmanager
def _native(path: str):
    """PARALLAX_NATIVE=`path` meanwhile ("": as it is); a server started now inherits it."""
    previous = os.environ.get(NATIVE_ENV)
    if path:
        os.environ[NATIVE_ENV] = path
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(NATIVE_ENV, None)
        else:
            os.environ[NATIVE_ENV] = previous


def run(settings: Settings, report: Callable[[Result], None]) -> None:
    too_big = [n for n in settings.ids if n > settings.vocab]
    if too_big:
        raise SystemExit(f"--ids {too_big} exceed --vocab {settings.vocab}; raise --vocab")
    for path in settings.paths:  # the same ids and gradients on each path
        with _native(path):
            label = native.describe().split(" ")[0]
        run_path(settings, path, lambda r, label=label: report(replace(r, path=label)))


def run_path(settings: Settings, path: str, report: Callable[[Result], None]) -> None:
    """Every configuration against one server started with PARALLAX_NATIVE=`path`."""
    server_mb = 256
    rng = np.random.default_rng(settings.seed)
    with contextlib.ExitStack() as stack:
        with _native(path):
            cluster = stack.enter_context(LocalCluster(
                1, extra_args=["--max-message-mb", str(server_mb)], echo=None))
        options = [ClientOptions(channels_per_server=c, chunk_mb=m)
                   for c in settings.channels for m in settings.chunk_mb]
        clients = [PSClient(cluster.addresses, o) for o in options]
        try:
            clients[0].wait_ready()
            for dim in settings.dims:
                for shards in settings.shards:
                    run_table(clients, dim, shards, settings, rng, report)
        finally:
            for client in clients:
                client.close()
            for echo in _ECHO_CLIENTS.values():
                echo.close()
            _ECHO_CLIENTS.clear()


# ---- output ------------------------------------------------------------------------------

COLUMNS = [("path", 6, "{}"), ("op", 11, "{}"), ("dim", 4, "{}"), ("ids", 7, "{}"),
           ("shards", 6, "{}"),
           ("ch", 3, "{}"), ("chunkMB", 7, "{}"), ("MB/req", 7, "{:.1f}"), ("reps", 4, "{}"),
           ("ms", 9, "{:.2f}"), ("Mrows/s", 8, "{:.3f}"), ("MB/s", 8, "{:.1f}"),
           ("memcpyMB/s", 10, "{:.0f}"), ("ratio", 6, "{:.3f}"), ("echoMB/s", 8, "{:.0f}"),
           ("vs echo", 7, "{:.2f}")]


def header() -> str:
    return "  ".join(name.rjust(width) for name, width, _ in COLUMNS)


def row(r: Result) -> str:
    values = [r.path, r.op, r.dim, r.ids, r.shards, r.channels, r.chunk_mb,
              r.ids * r.dim * 4 / MB, r.reps, r.median_s * 1e3, r.rows_per_s / 1e6,
              r.mb_per_s, r.memcpy_mb_per_s, r.ratio, r.echo_mb_per_s, r.echo_ratio]
    cells = [fmt.format(v).rjust(width) for (_, width, fmt), v in zip(COLUMNS, values)]
    line = "  ".join(cells)
    return line + (f"  ERROR: {r.error}" if r.error else "")


def code_version() -> dict[str, object]:
    """Commit and uncommitted changes of the parallax checkout being measured."""
    root = Path(parallax.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""
    changed = [line[3:] for line in git("status", "--porcelain").splitlines()
               if line[3:].endswith(".py") and not line[3:].startswith("examples/")]
    return {"path": str(root), "commit": git("rev-parse", "--short", "HEAD") or None,
            "uncommitted_py": changed}


def machine_info() -> dict[str, object]:
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
        "protobuf": f"{protobuf_version} ({api_implementation.Type()})",
        "loadavg_1m": round(os.getloadavg()[0], 2),  # other load on the box skews results
        "malloc_reuse": MALLOC_REUSE,
    }


def peaks(results: Sequence[Result]) -> dict[str, dict[str, object]]:
    """Best MB/s per op (and data path, where several ran), with its configuration."""
    best: dict[str, dict[str, object]] = {}
    several = len({r.path for r in results}) > 1
    for r in results:
        key = f"{r.op} {r.path}" if several else r.op
        if r.error is None and r.mb_per_s > best.get(key, {}).get("mb_per_s", -1.0):
            best[key] = asdict(r)
    return best


def write_json(path: Path, settings: Settings, results: Sequence[Result], seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "ps_throughput", "machine": machine_info(), "code": code_version(),
           "settings": asdict(settings),
           "total_seconds": seconds, "peaks": peaks(results),
           "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(doc, indent=2, allow_nan=True) + "\n")


# ---- CLI ---------------------------------------------------------------------------------

def int_list(text: str) -> tuple[int, ...]:
    """'4k,16384' -> (4096, 16384); a 'k' suffix means x1024."""
    def one(v: str) -> int:
        return int(v[:-1]) * 1024 if v.lower().endswith("k") else int(v)
    try:
        values = tuple(one(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints "
                                         f"(a 'k' suffix means x1024)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive ints")
    return values


def op_list(text: str) -> tuple[str, ...]:
    ops = tuple(v for v in text.split(",") if v)
    unknown = sorted(set(ops) - set(OPS))
    if unknown or not ops:
        raise argparse.ArgumentTypeError(f"unknown ops {unknown}; use a subset of {OPS}")
    return ops


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sweep (< 60 s); explicit flags still override it")
    p.add_argument("--dims", type=int_list, help="row widths (default 64,256)")
    p.add_argument("--ids", type=int_list,
                   help="unique ids per request, 'k' = 1024 (default 4k,16k,64k,256k)")
    p.add_argument("--shards", type=int_list, help="shards on the one server (default 1,2,4)")
    p.add_argument("--ops", type=op_list, help=f"subset of {','.join(OPS)}")
    p.add_argument("--channels", type=int_list, help="ClientOptions.channels_per_server values")
    p.add_argument("--chunk-mb", type=int_list, help="ClientOptions.chunk_mb values (default 4)")
    p.add_argument("--vocab", type=int, help="rows per table (default 1,000,000)")
    p.add_argument("--reps", type=int, help="timed repetitions per configuration (default 5)")
    p.add_argument("--warmup", type=int, help="untimed calls first (default 1)")
    p.add_argument("--budget-s", type=float,
                   help=f"seconds per configuration after which repetition stops "
                        f"(at least {MIN_REPS} reps are run; default 2)")
    p.add_argument("--seed", type=int, help="ids and gradients seed")
    p.add_argument("--out", help="JSON output path (default bench-results/ps_throughput.json)")
    p.add_argument("--paths", type=lambda t: tuple(v.strip() for v in t.split(",")),
                   help="the server's PARALLAX_NATIVE values to measure in turn, side by side "
                        "(e.g. 1,0: compiled kernels, then numpy; default: as set)")
    args = vars(p.parse_args(argv))
    base = QUICK if args.pop("quick") else Settings()
    return replace(base, **{k: v for k, v in args.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    info = machine_info()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print("code: " + ", ".join(f"{k}={v}" for k, v in code_version().items()))
    print(header(), flush=True)
    results: list[Result] = []

    def report(r: Result) -> None:
        results.append(r)
        print(row(r), flush=True)

    start = time.perf_counter()
    run(settings, report)
    seconds = time.perf_counter() - start
    for op, best in peaks(results).items():
        print(f"peak {op:18s}: {best['mb_per_s']:8.1f} MB/s  ({best['rows_per_s'] / 1e6:.3f} "
              f"Mrows/s, ratio {best['ratio']:.3f} to memcpy, {best['echo_ratio']:.2f} of raw "
              f"gRPC echo) at dim={best['dim']} ids={best['ids']} shards={best['shards']} "
              f"channels={best['channels']} chunk_mb={best['chunk_mb']}")
    out = Path(settings.out)
    write_json(out, settings, results, seconds)
    print(f"total {seconds:.1f} s; wrote {out}")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
