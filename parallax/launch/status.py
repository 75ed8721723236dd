"""`parallax status`: health and per-table statistics of every parameter server of a job.

For each server: its health (SERVING, NOT_SERVING, or UNREACHABLE with the error), then the
Stats RPC's view of every table shard it holds (rows, step, workers that pushed the open
step, requests, rows and bytes moved, errors). Exit code 0 when every server is SERVING,
1 otherwise, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from parallax.client import ClientOptions, PSClient
from parallax.client.cluster import parse_addresses
from parallax.env import ADDRESSES_ENV
from parallax.errors import ConfigError, ParallaxError
from parallax.runtime import logs

SERVING = "SERVING"
UNREACHABLE = "UNREACHABLE"


def client_options(timeout: float) -> ClientOptions:
    """The job's client options (TLS and token from the environment, when the security
    module provides them), with a short timeout and no retries: a status probe must not
    hang on a dead server."""
    options = ClientOptions()
    try:
        from parallax.client.connection import client_options_from_env
    except ImportError:
        pass
    else:
        options = client_options_from_env() or options
    return dataclasses.replace(options, timeout=timeout, retries=0)


def _health(client: PSClient, timeout: float) -> tuple[str, str | None]:
    connection = client.servers[0]
    # The connection's own channel, so the health check uses the job's credentials.
    stub = health_pb2_grpc.HealthStub(connection._channels[0])
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as err:
        return UNREACHABLE, f"{err.code().name}: {err.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), None


def _method_totals(methods) -> dict:
    """A table shard's pulls and pushes, single-table and multi-table (parts) together."""
    def total(names: tuple[str, ...], field: str) -> int:
        return sum(getattr(m, field) for m in methods if m.method in names)

    pulls, pushes = ("Pull", "PullMany"), ("Push", "PushMany")
    return {
        "pulls": total(pulls, "requests"),
        "pushes": total(pushes, "requests"),
        "rows_pulled": total(pulls, "rows"),
        "rows_pushed": total(pushes, "rows"),
        "bytes_pulled": total(pulls, "bytes"),
        "bytes_pushed": total(pushes, "bytes"),
        "errors": sum(m.errors for m in methods),
        "seconds": round(sum(m.total_seconds for m in methods), 6),
    }


def probe(address: str, options: ClientOptions) -> dict:
    """One server's health and table statistics, as plain data (never raises for the
    server's sake: an unreachable server is reported, not raised)."""
    found: dict = {"address": address, "health": UNREACHABLE, "error": None, "tables": []}
    with PSClient([address], options) as client:
        found["health"], found["error"] = _health(client, options.timeout)
        if found["health"] == UNREACHABLE:
            return found
        try:
            reply = client.stats()[address]
        except ParallaxError as exc:
            found["error"] = f"Stats failed: {exc}"
            return found
    found.update(version=reply.server_version, protocol=reply.protocol_version,
                 pid=reply.pid)
    for t in reply.tables:
        found["tables"].append({
            "table": t.table, "shard": t.shard_index, "shard_count": t.shard_count,
            "rows": t.rows, "dim": t.dim, "bytes": t.bytes, "step": t.step,
            "pushed_workers": list(t.pushed_workers), **_method_totals(t.methods),
            **({"dynamic": _dynamic(t.dynamic)} if t.HasField("dynamic") else {})})
    return found


def _dynamic(counters) -> dict[str, int]:
    """A dynamic table shard's admission and eviction counters (`--json` only)."""
    return {f.name: getattr(counters, f.name) for f in counters.DESCRIPTOR.fields}


def collect(addresses: list[str], options: ClientOptions) -> list[dict]:
    return [probe(a, options) for a in addresses]


_COLUMNS = (("table", "table", "{}"), ("shard", "shard", "{}"), ("rows", "rows", "{:,}"),
            ("dim", "dim", "{}"), ("MiB+slots", "bytes", "{:.1f}"), ("step", "step", "{}"),
            ("pushed", "pushed_workers", "{}"), ("pulls", "pulls", "{:,}"),
            ("pushes", "pushes", "{:,}"), ("rows pulled", "rows_pulled", "{:,}"),
            ("rows pushed", "rows_pushed", "{:,}"), ("errors", "errors", "{:,}"))


def _cell(table: dict, key: str, fmt: str) -> str:
    value = table[key]
    if key == "bytes":  # values and optimizer slots, in MiB (the plan's unit)
        value = value / 2**20
    if key == "pushed_workers":
        value = ",".join(map(str, value)) or "-"
    return fmt.format(value)


def format_table(servers: list[dict]) -> str:
    """A readable report: one heading line per server, then its table shards."""
    out = []
    for server in servers:
        head = f"{server['address']}  {server['health']}"
        if "pid" in server:
            head += f"  (parallax {server['version']}, pid {server['pid']})"
        if server["error"]:
            head += f"  error: {server['error']}"
        out.append(head)
        if not server["tables"]:
            if server["health"] == SERVING:
                out.append("  no tables")
            continue
        rows = [[name for name, _, _ in _COLUMNS]]
        rows += [[_cell(t, key, fmt) for _, key, fmt in _COLUMNS] for t in server["tables"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        for row in rows:
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
            out.append("  " + "  ".join(cells))
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="parallax status",
        description="Health and per-table statistics of every parameter server of a job. "
                    "Exit code 0 when every server is SERVING, 1 otherwise.")
    parser.add_argument("--ps-addresses", default=None,
                        help=f"comma-separated host:port of the servers (default: "
                             f"${ADDRESSES_ENV})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each server's answer (default 5)")
    return logs.parse(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.timeout <= 0:
            raise ConfigError(f"--timeout {args.timeout} must be > 0 seconds")
        text, source = args.ps_addresses, "--ps-addresses"
        if text is None:
            text, source = os.environ.get(ADDRESSES_ENV), ADDRESSES_ENV
        if text is None:
            raise ConfigError(f"no servers given: pass --ps-addresses host:port,... or set "
                              f"{ADDRESSES_ENV}")
        addresses = list(parse_addresses(text, source))
        servers = collect(addresses, client_options(args.timeout))
    except ConfigError as exc:
        print(f"parallax status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"servers": servers}, indent=2, sort_keys=True))
    else:
        sys.stdout.write(format_table(servers))
    bad = [s["address"] for s in servers if s["health"] != SERVING or s["error"]]
    if bad:
        print(f"parallax status: {len(bad)} of {len(servers)} servers not healthy: "
              f"{', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0
