"""`horovodrun` whose gloo rendezvous server listens only where the workers are told to call.

Horovod 0.28.1's horovodrun has no option for the address of its rendezvous HTTP server:
`horovod.runner.util.network.find_port` binds ('', port), every interface, even when every
worker runs on this machine. `--network-interface(s)` only chooses what the workers are told
(HOROVOD_GLOO_RENDEZVOUS_ADDR, the IPv4 address of that interface, and HOROVOD_GLOO_IFACE,
which the workers' own gloo sockets bind to). For a single host horovodrun picks the
interface of 127.0.0.1. This script runs horovodrun's own command line with the rendezvous
server bound to that very address: loopback for a single host, the job's interface for
several.

`parallax run` starts it with horovodrun's interpreter (the script imports Horovod only, not
parallax): `python horovodrun_bound.py -np 2 -H localhost:2 --gloo COMMAND`.
"""
from __future__ import annotations

import sys


def _bind_rendezvous_to_server_ip() -> None:
    """Wrap gloo_run.launch_gloo: while it runs, the rendezvous server binds `server_ip`,
    the address the workers get in HOROVOD_GLOO_RENDEZVOUS_ADDR."""
    from horovod.runner import gloo_run
    from horovod.runner.http import http_server

    launch_gloo, find_port = gloo_run.launch_gloo, http_server.find_port

    def bound_launch_gloo(command, exec_command, settings, nics, env, server_ip):
        def bound_find_port(factory):
            return find_port(lambda address: factory((server_ip, address[1])))
        http_server.find_port = bound_find_port
        try:
            return launch_gloo(command, exec_command, settings, nics, env, server_ip)
        finally:
            http_server.find_port = find_port

    gloo_run.launch_gloo = bound_launch_gloo


def main() -> None:
    _bind_rendezvous_to_server_ip()
    from horovod.runner.launch import run_commandline
    sys.argv[0] = "horovodrun"
    sys.exit(run_commandline())


if __name__ == "__main__":
    main()
