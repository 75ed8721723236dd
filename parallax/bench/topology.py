"""Which processes a benchmark run starts, and on which emulated host each one lives.

A host is an emulated machine: a network namespace with its own rate-limited link and, under
`--cpu-share`, a CPU group holding it to `share` cores. Two placements:

* `colocated` (equal hardware, the default): W hosts for every system, one per worker.
  hybrid's and ps mode's parameter servers, and TensorFlow ParameterServerStrategy's servers,
  run inside worker hosts, server i on host i mod W (its namespace, its CPU group, its
  link), as the Parallax paper ran one server per machine; TF's coordinator runs on host 0.
  Horovod, MWMS and hybrid then use the same machines.
* `dedicated`: every process is a host of its own (workers, servers, the coordinator): at 4
  workers hybrid with 2 servers runs on 6 machines against Horovod's 4. Kept as a second
  setting, labelled with its hosts and cores.

A process keeps its own name (worker<i>, ps<i>, chief) wherever it lives, so its CPU is
still charged to it (the report's per-role figures); bytes are counted per host link, so on
a colocated host they are the worker's and its server's together, and a worker's traffic to
the server on its own host never crosses a link.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax.errors import ConfigError

COLOCATED = "colocated"
DEDICATED = "dedicated"
PLACEMENTS = (COLOCATED, DEDICATED)
SERVED = ("hybrid", "hybrid_tf", "ps", "tf_ps")  # systems with parameter servers
COORDINATED = ("tf_ps",)                           # systems with a TF coordinator `chief`


@dataclass(frozen=True)
class Process:
    """One process of a run: its name (whose CPU it is), its role (the argument of the
    benchmark worker, or "server" for a parallax server) and the host it runs on."""

    name: str
    role: str
    host: str


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement {placement!r} is not known: choose {COLOCATED} (servers "
                          f"inside worker hosts: equal hardware) or {DEDICATED} (a host per "
                          f"process)")
    return placement


def host_of(name: str, workers: int, placement: str) -> str:
    """The host of process `name` (worker<i>, ps<i>, chief) in a run of `workers` workers."""
    check_placement(placement)
    if workers < 1:
        raise ConfigError(f"a run needs >= 1 worker, got {workers}")
    if placement == DEDICATED or name.startswith("worker"):
        return name
    if name == "chief":
        return "worker0"
    if name.startswith("ps") and name[2:].isdigit():
        return f"worker{int(name[2:]) % workers}"
    raise ConfigError(f"process name {name!r} is not worker<i>, ps<i> or chief")


def processes(system: str, workers: int, servers: int, placement: str) -> list[Process]:
    """Every process a run of `system` (a base system: see harness.base_system) starts,
    servers first, as the harness starts them."""
    names: list[tuple[str, str]] = []
    if system in SERVED:
        role = "ps" if system == "tf_ps" else "server"
        names += [(f"ps{i}", role) for i in range(servers)]
    names += [(f"worker{i}", "worker") for i in range(workers)]
    if system in COORDINATED:
        names.append(("chief", "chief"))
    return [Process(name, role, host_of(name, workers, placement)) for name, role in names]


def hosts(system: str, workers: int, servers: int, placement: str) -> list[str]:
    """The emulated machines a run uses, each once, in start order."""
    return list(dict.fromkeys(p.host for p in processes(system, workers, servers, placement)))


def cluster_hosts(max_workers: int, servers: int, placement: str) -> list[str]:
    """Every namespace any run of a setting may need (`dedicated`: the coordinator, the most
    workers, the servers; `colocated`: the most workers only)."""
    workers = [f"worker{i}" for i in range(max_workers)]
    if check_placement(placement) == COLOCATED:
        return workers
    return ["chief"] + workers + [f"ps{i}" for i in range(servers)]


def cores(host_count: int, share: float | None) -> float | None:
    """The cores a run's processes were held to in all; None on shared cores."""
    return None if share is None else host_count * share
