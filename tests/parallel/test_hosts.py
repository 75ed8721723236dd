"""Host files (parallax/launch/hosts.py): every format (horovodrun's host file and host string,
YAML, and parallax's deprecated `host: ids` lines), the layout they give, their errors, and
the GPU ids."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallax.errors import ConfigError
from parallax.launch.backends import BACKENDS, choose
from parallax.launch.backends.horovodrun import horovodrun_argv
from parallax.launch.module_argv import own_module
from parallax.launch.hosts import (ClusterLayout, HostSpec, _gpus, is_local, load_hosts,
                                   parse_host_string, parse_hosts, with_devices)


def test_yaml_gpus_keep_the_ids_and_give_one_server_per_host():
    layout = parse_hosts("# cluster\nhosts:\n- {host: 10.0.0.1, gpus: [0, 1, 2]}\n"
                         "- {host: worker-b, ssh_user: root, gpus: [3]}  # one GPU\n- host-c\n")
    assert layout == ClusterLayout((HostSpec("10.0.0.1", 3, 1, gpus=(0, 1, 2)),
                                    HostSpec("worker-b", 1, 1, "root", gpus=(3,)),
                                    HostSpec("host-c", 1, 1)), 7000)
    assert layout.num_slots == 5 and layout.num_servers == 3
    assert layout.horovod_hosts() == "10.0.0.1:3,worker-b:1,host-c:1"
    assert layout.horovod_hosts(4) == "10.0.0.1:3,worker-b:1"
    assert layout.server_addresses() == ["10.0.0.1:7000", "worker-b:7000", "host-c:7000"]
    assert layout.hosts[1].ssh_target == "root@worker-b"


def test_the_deprecated_lines_still_work_and_say_what_to_write(caplog):
    """`host: ids` lines give what their YAML gives, with one warning (per file) that spells
    that YAML; a file of bare host names is horovodrun's (one slot each), and not warned."""
    text = "# cluster\n10.0.0.1: 0,1,2\n\nroot@worker-b: 3  # one GPU\nhost-c\n"
    with caplog.at_level("WARNING", logger="parallax"):
        layout = parse_hosts(text, "old.txt")
        assert parse_hosts(text, "old.txt") == layout  # warned once
    warned = [r.getMessage() for r in caplog.records]
    yaml = ("hosts: [{host: 10.0.0.1, gpus: [0, 1, 2]}, {host: worker-b, ssh_user: root, "
            "gpus: [3]}, {host: host-c}]")
    assert warned == [f"old.txt: `host: 0,1` lines are deprecated (they still work); write "
                      f"Horovod's `host slots=N` lines, or, to keep the GPU ids, YAML: {yaml}"]
    assert parse_hosts(yaml) == layout
    caplog.clear()
    with caplog.at_level("WARNING", logger="parallax"):
        assert parse_hosts("a\n[::1]\n").hosts == (HostSpec("a"), HostSpec("[::1]"))
    assert not caplog.records


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
    ("# nothing\n", "no hosts; list at least one (e.g. `localhost slots=1`"),
    ("bad host: 0\n", "line 1: 'bad host: 0' should be `host slots=N`"),
    ("bad!host slots=1\n", "line 1: 'bad!host' is not a host name"),
    ("bad!host: 0\n", "line 1: 'bad!host' is not a host name"),
    ("hosts:\n  - {host: a, slots: 0}\n", "line 2: slots 0 must be a whole number >= 1"),
    ("hosts:\n  - {host: a}\n  - {host: a}\n", "line 3: host 'a' is listed again"),
    ("server_port: 70000\nhosts: [a]\n", "line 1: server_port 70000 is not a port; give a "
                                         "number in 1-65535"),
    ("hosts:\n  - host: a\n    ssh_port: x\n", "line 3: ssh_port 'x' is not a port"),
    ("hosts:\n  - {host: a, gpus: 2}\n", "line 2: gpus 2 must be a list of GPU ids, e.g. "
                                         "[0, 1]"),
    ("hosts:\n  - {host: a, gpus: [1, 1]}\n", "gpus [1, 1] repeat an id"),
    ("hosts:\n  - {host: a, gpus: [0, 1], slots: 3}\n", "slots 3 but 2 gpus: one worker runs "
                                                       "per GPU id"),
    ("hosts:\n  - {host: a, colour: red}\n", "line 2: unknown host key 'colour'"),
    ("hosts:\n  - {slots: 2}\n", "line 2: this host has no `host:`"),
    ("hosts: a\n", "line 1: `hosts` must be a list"),
    ("hosts: [\n", "not valid YAML"),
    ("servers: 2\nhosts: [a]\n", "line 1: unknown key 'servers'"),
    ("server_port: 65535\nhosts: [{host: a, servers: 2}]\n", "choose a lower server_port"),
    ("hosts:\n  - {host: a, servers: -1}\n", "servers -1 must be a whole number >= 0"),
    ("a slots=1\nb slots=x\n", "line 2: 'b slots=x' should be `host slots=N`"),
    # horovodrun's host strings (-H)
    ("-H localhost:0", "-H localhost:0: 'localhost:0' should be host:N with N >= 1"),
    ("-H a:1,a:2", "host 'a' is listed again"),
    ("-H bad!host:1", "'bad!host' is not a host name"),
])
def test_malformed_files_name_the_line_and_the_fix(text, words):
    with pytest.raises(ConfigError) as info:
        if text.startswith("-H "):
            parse_host_string(text[3:])
        else:
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
        [sys.executable, "-m", "parallax.launch.hosts", "serve", sys.executable, "-c",
         "import time, sys; print('up', flush=True); time.sleep(60)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert wrapper.stdout.readline().strip() == "up"
    started = time.monotonic()
    wrapper.stdin.close()  # what the end of the ssh session does
    assert wrapper.wait(15) == 128 + 15  # the server was SIGTERMed
    assert time.monotonic() - started < 10


def test_horovodrun_host_string_one_server_each_at_a_free_port():
    layout = parse_host_string("localhost:2,alice@10.0.0.2:3")
    assert [(h.host, h.slots, h.servers, h.ssh_user, h.gpus) for h in layout.hosts] == \
        [("localhost", 2, 1, None, ()), ("10.0.0.2", 3, 1, "alice", ())]
    assert layout.server_port == 0 and layout.num_slots == 5


def test_a_host_string_is_read_as_a_file_only_when_that_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_hosts("localhost:2").hosts == (HostSpec("localhost", 2, 1),)
    Path("localhost:2").write_text("worker-a slots=1\n")
    assert load_hosts("localhost:2").hosts[0].host == "worker-a"
    with pytest.raises(ConfigError, match=r"--hosts a:2,b: cannot read it .*host:slots"):
        load_hosts("a:2,b")


def test_horovodrun_hostfile_format():
    layout = parse_hosts("# horovodrun's\n10.0.0.1 slots=4\nbob@worker-b  slots = 2\n"
                         "worker-c\n")
    assert [(h.host, h.slots, h.servers, h.ssh_user) for h in layout.hosts] == \
        [("10.0.0.1", 4, 1, None), ("worker-b", 2, 1, "bob"), ("worker-c", 1, 1, None)]
    assert layout.server_port == 7000


GPU_HOSTS = "hosts: [{host: localhost, gpus: [2, 3]}, {host: worker-b, gpus: [0]}, " \
            "{host: 192.0.2.1, gpus: [5, 6]}]"


def test_gpu_ids_become_each_workers_cuda_visible_devices():
    layout = parse_hosts(GPU_HOSTS)
    assert layout.hosts[0].gpus == (2, 3)
    program = ["python", "train.py"]
    argv = with_devices(layout, 3, program)
    assert argv == [*own_module("parallax.launch.hosts"), "gpus", "localhost=2,3",
                    "worker-b=0", "--", *program]
    argv = argv[argv.index("gpus"):]
    assert with_devices(parse_host_string("localhost:2"), 2, program) == program
    env = {"HOROVOD_HOSTNAME": "localhost", "HOROVOD_LOCAL_RANK": "1"}
    assert _gpus(argv[1:], env) == program and env["CUDA_VISIBLE_DEVICES"] == "3"
    env = {"HOROVOD_HOSTNAME": "worker-c", "CUDA_VISIBLE_DEVICES": "7"}  # not listed: as is
    assert _gpus(argv[1:], env) == program and env["CUDA_VISIBLE_DEVICES"] == "7"
    env = {}  # one worker, no Horovod: the first host's first id
    assert _gpus(argv[1:], env) == program and env["CUDA_VISIBLE_DEVICES"] == "2"


def test_gpu_ids_of_the_tensorflow_supervisors_workers_follow_their_host_and_local_rank():
    """Without Horovod a worker finds its host and local rank in PARALLAX_WORKERS (the
    supervisor maps "localhost" to 127.0.0.1, and names an ssh host by its address)."""
    layout = parse_hosts("hosts: [{host: localhost, gpus: [2, 3]}, "
                         "{host: 192.0.2.1, ssh_user: carol, gpus: [5, 6]}]")
    argv = with_devices(layout, 4, ["prog"])
    argv = argv[argv.index("gpus") + 1:]
    workers = "127.0.0.1:1,127.0.0.1:2,192.0.2.1:3,192.0.2.1:4"
    for rank, device in enumerate(["2", "3", "5", "6"]):
        env = {"PARALLAX_WORKERS": workers, "PARALLAX_WORKER_RANK": str(rank)}
        assert _gpus(argv, env) == ["prog"] and env["CUDA_VISIBLE_DEVICES"] == device, rank


def test_the_gpus_wrapper_execs_the_program_with_its_device():
    done = subprocess.run(
        [sys.executable, "-m", "parallax.launch.hosts", "gpus", "h1=4,5", "--", sys.executable,
         "-c",
         "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.getpid())"],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, "HOROVOD_HOSTNAME": "h1", "HOROVOD_LOCAL_RANK": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "5"


def test_horovodrun_argv_for_a_layout():
    layout = parse_hosts("localhost slots=2\ncarol@192.0.2.1\n")
    argv = horovodrun_argv(layout, 3, ["prog"], "/bin/horovodrun", ("--verbose",))
    assert argv == ["/bin/horovodrun", "-np", "3", "-H", "localhost:2,carol@192.0.2.1:1",
                    "--gloo", "--verbose", "prog"]
    assert choose(layout, 1) is BACKENDS["single"]
    assert choose(layout, 2) is BACKENDS["horovodrun"]
    remote_first = parse_hosts("carol@192.0.2.1\nlocalhost\n")
    assert choose(remote_first, 1) is BACKENDS["horovodrun"]  # one worker, over ssh


def test_a_job_no_backend_accepts_is_refused_with_the_backends_and_hosts(monkeypatch):
    from parallax.errors import ConfigError
    from parallax.launch import backends
    monkeypatch.setattr(backends, "BACKENDS", {"single": BACKENDS["single"]})
    with pytest.raises(ConfigError, match=r"no launch backend \(single\) can start 2 worker\(s\) "
                                          r"on hosts \['localhost'\]"):
        backends.choose(parse_host_string("localhost:2"), 2)
