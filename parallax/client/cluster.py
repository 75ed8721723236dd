"""Where the parameter servers are: from explicit arguments, from the launcher's environment,
or (nothing configured) servers this process starts on loopback: the embedded default.

The launcher (`parallax run`) and workers agree on two variables:
  PARALLAX_PS_ADDRESSES  comma-separated host:port of every parameter server
  PARALLAX_RUN_ID        the job's id; table names on the servers are prefixed with it

A TensorFlow cluster description works too: without PARALLAX_PS_ADDRESSES, the "ps" tasks of
TF_CONFIG's cluster are the parameter servers (each must run `parallax server` at that
address), and the run id, unless given, is derived from the cluster, so every worker of one
cluster agrees on it. Worker ranks still come from Horovod.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
from dataclasses import dataclass

from parallax.env import (ADDRESSES_ENV, MODE_ENV, RUN_ID_ENV, SYNC_ENV, SYNC_MODES, TF_CONFIG_ENV,
                          check_run_id, new_run_id)
from parallax.errors import ConfigError

_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


@dataclass(frozen=True)
class ClusterSpec:
    ps_addresses: tuple[str, ...]
    run_id: str
    embedded: bool = False  # True: servers started by this process, stopped at exit


def parse_addresses(text: str, source: str) -> tuple[str, ...]:
    addresses = tuple(a.strip() for a in text.split(",") if a.strip())
    if not addresses:
        raise ConfigError(f"{source} is empty; give host:port of each parameter server, "
                          f"comma-separated (e.g. 10.0.0.1:7000,10.0.0.2:7000)")
    for address in addresses:
        port = address.rsplit(":", 1)[-1]
        if not _ADDRESS.match(address) or not 0 < int(port) < 65536:
            raise ConfigError(f"{source}: {address!r} is not host:port with a port in "
                              f"1-65535 (e.g. 127.0.0.1:7000)")
    return addresses


def mode_from_env(mode: str | None, sync: bool | None,
                  environ: dict[str, str] | None = None) -> tuple[str, bool]:
    """Explicit arguments win; then the launcher's environment; then hybrid, sync."""
    environ = os.environ if environ is None else environ
    if mode is None:
        mode = environ.get(MODE_ENV) or "hybrid"
    if sync is None:
        text = environ.get(SYNC_ENV, "sync")
        if text not in SYNC_MODES:
            raise ConfigError(f"{SYNC_ENV}={text!r} must be 'sync' or 'async'")
        sync = text == "sync"
    return mode, sync


def resolve_cluster(ps_addresses: str | tuple[str, ...] | list[str] | None = None,
                    run_id: str | None = None, *, embedded_servers: int = 2,
                    environ: dict[str, str] | None = None, start: bool = True) -> ClusterSpec:
    """Explicit arguments win over the environment; with neither, start local servers (with
    start=False: return the spec they would have, with no addresses yet)."""
    environ = dict(os.environ if environ is None else environ)
    if run_id is None:
        run_id = environ.get(RUN_ID_ENV) or None
    if ps_addresses is not None:
        text = ps_addresses if isinstance(ps_addresses, str) else ",".join(ps_addresses)
        addresses = parse_addresses(text, "ps_addresses")
    elif environ.get(ADDRESSES_ENV):
        addresses = parse_addresses(environ[ADDRESSES_ENV], ADDRESSES_ENV)
    elif environ.get(TF_CONFIG_ENV) and (tf := tf_config_servers(environ[TF_CONFIG_ENV])):
        addresses, run_id = tf[0], run_id or tf[1]
    elif start:
        return _embedded(embedded_servers, run_id or new_run_id())
    else:
        return ClusterSpec(("",) * embedded_servers, check_run_id(run_id or new_run_id(),
                                                                  "run id"), embedded=True)
    return ClusterSpec(addresses, check_run_id(run_id or new_run_id(), "run id"))


def tf_config_servers(text: str) -> tuple[tuple[str, ...], str] | None:
    """(the "ps" addresses of a TF_CONFIG cluster, a run id every task derives alike), or
    None for a cluster without "ps" tasks (MultiWorkerMirroredStrategy's)."""
    try:
        cluster = json.loads(text)["cluster"]
        ps = cluster.get("ps")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{TF_CONFIG_ENV} is not a TensorFlow cluster description "
                          f"({exc!r}); give {{\"cluster\": {{\"worker\": [...], \"ps\": "
                          f"[\"host:port\", ...]}}, \"task\": {{...}}}}") from None
    if ps is None:
        return None
    if not isinstance(ps, list) or not all(isinstance(a, str) for a in ps):
        raise ConfigError(f"{TF_CONFIG_ENV}: cluster.ps must be a list of \"host:port\" "
                          f"strings, got {ps!r}")
    addresses = parse_addresses(",".join(ps), f"{TF_CONFIG_ENV} cluster.ps")
    digest = hashlib.sha256(json.dumps(cluster, sort_keys=True).encode()).hexdigest()
    return addresses, f"tf-{digest[:12]}"


def _embedded(num_servers: int, run_id: str) -> ClusterSpec:
    """Start `num_servers` parameter servers as children of this process (loopback)."""
    from parallax.client.local_cluster import LocalCluster

    cluster = LocalCluster(num_servers).start()
    atexit.register(cluster.stop)
    return ClusterSpec(tuple(cluster.addresses), check_run_id(run_id, "run id"), embedded=True)
