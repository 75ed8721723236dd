"""Host files (parallax/hosts.py): both formats, the layout they give, and their errors."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from parallax.errors import ConfigError
from parallax.hosts import ClusterLayout, HostSpec, is_local, load_hosts, parse_hosts


def test_parallax_format_counts_slot_ids_and_gives_one_server_per_host():
    layout = parse_hosts("# cluster\n10.0.0.1: 0,1,2\n\nroot@worker-b: 3  # one GPU\nhost-c\n")
    assert layout == ClusterLayout((HostSpec("10.0.0.1", 3, 1), HostSpec("worker-b", 1, 1,
                                                                        "root"),
                                    HostSpec("host-c", 1, 1)), 7000)
    assert layout.num_slots == 5 and layout.num_servers == 3
    assert layout.horovod_hosts() == "10.0.0.1:3,worker-b:1,host-c:1"
    assert layout.horovod_hosts(4) == "10.0.0.1:3,worker-b:1"
    assert layout.server_addresses() == ["10.0.0.1:7000", "worker-b:7000", "host-c:7000"]
    assert layout.hosts[1].ssh_target == "root@worker-b"


def test_yaml_format_with_defaults_and_overrides():
    layout = parse_hosts(
        "server_port: 7100\nssh_user: alice\nhosts:\n"
        "  - {host: 10.0.0.1, slots: 2, servers: 2}\n"
        "  - host: 10.0.0.2\n    ssh_user: root\n    ssh_port: 2222\n    servers: 0\n"
        "  - 10.0.0.3\n")
    assert layout.server_port == 7100
    assert layout.hosts == (HostSpec("10.0.0.1", 2, 2, "alice", None),
                            HostSpec("10.0.0.2", 1, 0, "root", 2222),
                            HostSpec("10.0.0.3", 1, 1, "alice", None))
    assert layout.server_addresses() == ["10.0.0.1:7100", "10.0.0.1:7101", "10.0.0.3:7100"]
    with pytest.raises(AttributeError):
        layout.server_port = 1  # frozen


def test_yaml_flow_form_and_load_from_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("{hosts: [{host: a, slots: 1}, {host: b, slots: 3}]}\n")
    layout = load_hosts(path)
    assert [(h.host, h.slots, h.servers) for h in layout.hosts] == [("a", 1, 1), ("b", 3, 1)]
    assert layout.server_port == 7000


@pytest.mark.parametrize("text, words", [
    ("a: 0,1\nb: 0\na: 2\n", "<hosts>, line 3: host 'a' is listed again (first at <hosts>, "
                              "line 1)"),
    ("a: 0,x\n", "line 1: 'a: 0,x' should be `host: 0,1,2`"),
    ("a:\n", "line 1: 'a:' should be `host: 0,1,2`"),
    ("a: 0,0\n", "repeat one"),
    ("# nothing\n", "no hosts"),
    ("bad host: 0\n", "line 1: 'bad host' is not a host name"),
    ("hosts:\n  - {host: a, slots: 0}\n", "line 2: slots 0 must be a whole number >= 1"),
    ("hosts:\n  - {host: a}\n  - {host: a}\n", "line 3: host 'a' is listed again"),
    ("server_port: 70000\nhosts: [a]\n", "line 1: server_port 70000 is not a port; give a "
                                         "number in 1-65535"),
    ("hosts:\n  - host: a\n    ssh_port: x\n", "line 3: ssh_port 'x' is not a port"),
    ("hosts:\n  - {host: a, gpus: 2}\n", "line 2: unknown host key 'gpus'"),
    ("hosts:\n  - {slots: 2}\n", "line 2: this host has no `host:`"),
    ("hosts: a\n", "line 1: `hosts` must be a list"),
    ("hosts: [\n", "not valid YAML"),
    ("servers: 2\nhosts: [a]\n", "line 1: unknown key 'servers'"),
    ("server_port: 65535\nhosts: [{host: a, servers: 2}]\n", "choose a lower server_port"),
    ("hosts:\n  - {host: a, servers: -1}\n", "servers -1 must be a whole number >= 0"),
])
def test_malformed_files_name_the_line_and_the_fix(text, words):
    with pytest.raises(ConfigError) as info:
        parse_hosts(text)
    assert words in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        load_hosts(tmp_path / "nope.txt")


def test_is_local():
    assert is_local("localhost") and is_local("127.0.0.1")
    assert not is_local("192.0.2.1")  # TEST-NET-1: never on this machine
    assert not is_local("no-such-host.invalid")


def test_serve_wrapper_stops_the_server_when_stdin_closes():
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "parallax.hosts", "serve", sys.executable, "-c",
         "import time, sys; print('up', flush=True); time.sleep(60)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert wrapper.stdout.readline().strip() == "up"
    started = time.monotonic()
    wrapper.stdin.close()  # what the end of the ssh session does
    assert wrapper.wait(15) == 128 + 15  # the server was SIGTERMed
    assert time.monotonic() - started < 10
