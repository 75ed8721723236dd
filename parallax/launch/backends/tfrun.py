"""The `tensorflow` launch backend: N workers, on this machine and over ssh, without Horovod,
whose dense gradients go through TensorFlow's own collectives
(`parallax.tf.collectives.tensorflow`).

Its one command is a small supervisor, `tf_supervisor.py` beside this file, which keeps
horovodrun's output contract: the launcher reads both alike.
"""
from __future__ import annotations

import json
import socket

from parallax.errors import ConfigError
from parallax.launch.backends.base import WorkerBackend
from parallax.launch.backends.horovodrun import Horovodrun, horovod_installed
from parallax.launch.hosts import ClusterLayout, is_local, worker_hosts
from parallax.launch.module_argv import own_module

SUPERVISOR = "parallax.launch.backends.tf_supervisor"


class TensorFlowRun(WorkerBackend):
    name = "tensorflow"
    who = "the workers (parallax's TensorFlow supervisor)"

    def accepts(self, layout: ClusterLayout, num_workers: int, collectives: str = "auto"
                ) -> bool:
        """Several workers, with TensorFlow's collectives asked for (or Horovod missing)."""
        return collectives == "tensorflow" or (collectives == "auto"
                                               and not horovod_installed())

    def argv(self, layout: ClusterLayout, num_workers: int, program: list[str],
             extra_args: tuple[str, ...] = ()) -> list[str]:
        if extra_args:
            raise ConfigError(f"--horovodrun-arg {' '.join(extra_args)}: the workers start "
                              f"without horovodrun (--collectives tensorflow, or Horovod "
                              f"missing); drop it, or use --collectives horovod")
        return [*own_module(SUPERVISOR), "--hosts",
                json.dumps(supervisor_hosts(layout, num_workers)), "--", *program]

    def forwarded(self, env: dict[str, str]) -> dict[str, str]:
        from parallax.launch.backends.tf_supervisor import forwarded
        return forwarded(env)

    rank_line = Horovodrun.rank_line  # the same output contract as horovodrun's
    failure = Horovodrun.failure


def supervisor_hosts(layout: ClusterLayout, num_workers: int) -> list[dict]:
    """The supervisor's --hosts: each host of the first `num_workers` slots, its address
    and workers, and how to reach it over ssh unless it is this machine. "localhost" is
    127.0.0.1 when every worker is here, else this machine's address on the route to the
    first other host (the others must reach its workers)."""
    hosts = []
    placed = worker_hosts(layout, num_workers)
    remote = [h.host.strip("[]") for h, _, _ in placed if not is_local(h.host)]
    for host, _, take in placed:
        address = host.host.strip("[]")
        if address == "localhost":
            address = "127.0.0.1"
        if remote and _loopback(address):  # the other hosts could not reach it
            address = _address_toward(remote[0])
        entry: dict = {"host": address, "workers": take}
        if not is_local(host.host):
            entry["ssh_target"] = host.ssh_target
            if host.ssh_port is not None:
                entry["ssh_port"] = host.ssh_port
        hosts.append(entry)
    return hosts


def _loopback(address: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _address_toward(host: str) -> str:
    """This machine's address on the route to `host` (what that host can reach it at)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 22, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # (UDP: nothing is sent; the route is looked up)
            return probe.getsockname()[0]
    except OSError as err:
        raise ConfigError(f"the host file names this machine as a loopback address and "
                          f"{host} as another host, and no route to {host} gives this "
                          f"machine's own address ({err}): name this machine by an address "
                          f"{host} can reach") from None
