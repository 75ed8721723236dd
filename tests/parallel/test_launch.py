"""`parallax run`: real servers, real workers (tests/helpers/launch_probe.py), horovodrun on
loopback.

Every launcher started here runs with a unique LAUNCH_TEST_MARK in its environment, which all
its descendants inherit (servers, horovodrun and its helpers, workers); after each test no
running process may carry it: that is the orphan check (tests/helpers/launching.py).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import parallax
from parallax.client.local_cluster import LocalCluster
from parallax.errors import ConfigError
from parallax.launch.run import (LaunchConfig, parse_args, run, validate, worker_metrics_env,
                                 workers_argv)
from launching import PROBE, RENDEZVOUS_PROBE, marked_processes, port_closed, wait_gone
from launching import Launcher, mark  # noqa: F401 (mark: a fixture)


@pytest.mark.multiprocess
def test_two_workers_two_servers(mark):
    launcher = Launcher("-np", "2", "--servers", "2", "--run-id", "two-by-two", PROBE,
                        mark=mark)
    assert launcher.wait() == 0, launcher.output()
    probes = launcher.probes()
    assert sorted(p["rank"] for p in probes) == [0, 1], launcher.output()
    assert {p["size"] for p in probes} == {2}
    assert {p["run_id"] for p in probes} == {"two-by-two"}
    addresses = probes[0]["addresses"]
    assert len(addresses) == 2 and probes[1]["addresses"] == addresses
    start = launcher.start_line()
    assert "2 worker(s)" in start and "run id two-by-two" in start
    assert ",".join(addresses) in start
    assert all(port_closed(a) for a in addresses)


@pytest.mark.multiprocess
def test_mode_and_async_reach_every_worker(mark):
    launcher = Launcher("-np", "2", "--servers", "1", "--mode", "ps", "--async", PROBE,
                        mark=mark)
    assert launcher.wait() == 0, launcher.output()
    probes = launcher.probes()
    assert len(probes) == 2, launcher.output()
    assert {(p["mode"], p["sync"]) for p in probes} == {("ps", "async")}


@pytest.mark.multiprocess
def test_mode_and_sync_are_unset_by_default_and_set_through_the_api(capfd, monkeypatch):
    monkeypatch.delenv("PARALLAX_MODE", raising=False)
    monkeypatch.delenv("PARALLAX_SYNC", raising=False)
    for fields, expected in [({}, (None, None)), ({"mode": "allreduce", "sync": True},
                                                  ("allreduce", "sync"))]:
        config = LaunchConfig(num_workers=1, num_servers=1, command=(PROBE,), **fields)
        assert run(config) == 0
        [line] = [x for x in capfd.readouterr().out.splitlines() if '{"probe"' in x]
        probe = json.loads(line)
        assert (probe["mode"], probe["sync"]) == expected


@pytest.mark.multiprocess
def test_failing_worker_exit_code_comes_through_horovodrun(mark):
    launcher = Launcher("-np", "2", "--", "python", PROBE, "--exit", "3", "--exit-rank", "1",
                        mark=mark)
    assert launcher.wait() == 3, launcher.output()  # horovodrun itself exits 1
    assert any("worker rank 1 exited with code 3" in line for line in launcher.err)
    report = "\n".join(launcher.err)
    assert "  [1] {\"probe\": 1, \"rank\": 1" in report.split("Its last output:\n")[1], report
    assert all(port_closed(a) for a in launcher.probes()[0]["addresses"])


@pytest.mark.horovod
@pytest.mark.multiprocess
def test_horovodrun_listens_on_loopback_for_one_host(mark):
    """horovodrun's rendezvous server binds the address its workers are given (loopback
    here), not every interface (issue 13, item 10d)."""
    launcher = Launcher("-np", "2", "--servers", "1", RENDEZVOUS_PROBE, mark=mark)
    assert launcher.wait() == 0, launcher.output()
    lines = [line for line in launcher.out if "RENDEZVOUS" in line]
    assert len(lines) == 2, launcher.output()
    assert all("addr=127.0.0.1 listen=0100007F" in line for line in lines), lines


@pytest.mark.horovod
def test_horovodruns_gloo_check_asks_the_extension_not_tensorflow(monkeypatch):
    """horovodrun asks "was Horovod built with Gloo?" before every launch, restarts too, by
    importing TensorFlow in a child (2-3 s here); horovodrun_bound asks the TensorFlow
    extension's own horovod_gloo_built() in a child that loads it with ctypes. Only its yes
    is taken: anything else leaves the answer to Horovod's own check."""
    from horovod.runner import launch

    from parallax.launch.backends import horovodrun_bound as bound
    assert bound.extension_said_yes(bound.ask_extension())
    for child, answer in (("print(True)", True), ("print(False)", "horovod's"),
                          ("raise SystemExit(3)", "horovod's"), (None, "horovod's")):
        monkeypatch.setattr(launch, "gloo_built", lambda verbose=False: "horovod's")
        bound.quick_gloo_built(None if child is None else subprocess.Popen(
            [sys.executable, "-c", child], stdout=subprocess.PIPE))
        assert launch.gloo_built() == answer, child


# As horovodrun's middleman of a rank: in a session of its own, end a shell (argv[1]) with
# horovodrun_bound.end_shell_and_children; print the seconds it took and the processes of
# the session left but this one (zombies aside: what reaps orphans here may be slow to).
_MIDDLEMAN = """
import os, subprocess, sys, time
import psutil
from parallax.launch.backends import horovodrun_bound
os.setsid()
shell = subprocess.Popen(["sh", "-c", sys.argv[1]])
time.sleep(0.5)  # its commands run
started = time.monotonic()
horovodrun_bound.end_shell_and_children(shell.pid)
took = time.monotonic() - started
shell.wait()
time.sleep(0.1)
left = [p.pid for p in psutil.process_iter() if p.pid != os.getpid()
        and os.getsid(p.pid) == os.getpid() and p.status() != psutil.STATUS_ZOMBIE]
print(round(took, 3), left, flush=True)
"""


@pytest.mark.horovod
@pytest.mark.parametrize("shell", ["sleep 30; sleep 0.2", "(sleep 30 &); sleep 30"])
def test_a_ranks_shell_ends_at_once_and_leaves_nothing_in_its_session(shell):
    """When a rank fails, horovodrun's middlemen SIGTERM the other ranks' commands, then
    SIGSTOP each rank's shell before they SIGTERM it: a shell stopped before it exited sat
    out 5 s until SIGKILL (a race; a shell with one more command to run loses it most times:
    5.0 s in 2 of 3 tries). horovodrun_bound's end_shell_and_children, which its middlemen
    run, leaves the shell running to take the SIGTERM, and kills what is left in the
    middleman's session: here a command put in the background (what its shell started as
    the rank ended would be left the same way)."""
    done = subprocess.run([sys.executable, "-c", _MIDDLEMAN, shell], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    took, left = done.stdout.split(" ", 1)
    assert float(took) < 2 and left.strip() == "[]", done.stdout


@pytest.mark.multiprocess
def test_the_first_failing_rank_is_reported_with_its_traceback(mark):
    """Rank 1 raises (its traceback goes to stderr, nothing to stdout): the report names it
    and repeats the end of its traceback (issue 13, item 10f: it said "(none)")."""
    code = ("import os, time\n"
            "if os.environ.get('HOROVOD_RANK', os.environ.get('PARALLAX_WORKER_RANK')) == '1':\n"
            "    raise RuntimeError('the root cause, in rank 1')\n"
            "time.sleep(60)\n")
    launcher = Launcher("-np", "2", "--servers", "1", "--", "python", "-c", code, mark=mark)
    assert launcher.wait() == 1, launcher.output()
    report = "\n".join(launcher.err)
    assert "worker rank 1 exited with code 1 first" in report, report
    last = report.split("Its last output:\n", 1)[1]
    assert "[1] RuntimeError: the root cause, in rank 1" in last, report
    assert "[1] Traceback (most recent call last):" in last, report
    assert "[1]<stderr>:Traceback" in report  # still forwarded as it came


@pytest.mark.horovod
@pytest.mark.multiprocess
def test_a_worker_failing_in_a_collective_names_the_peer_that_caused_it(mark):
    """Rank 1 raises (or exits 0) while rank 0 waits in an all-reduce; rank 1 is slow to end
    (as TensorFlow's teardown is), so rank 0's "Horovod has been shut down" comes first. The
    report says that is collateral and names rank 1's exception, or a finished peer."""
    code = ("import atexit, os, sys, time\n"
            "rank = os.environ['HOROVOD_RANK']\n"
            "atexit.register(time.sleep, 5 if rank == '1' else 0)  # after Horovod's shutdown\n"
            "import tensorflow as tf, horovod.tensorflow as hvd\n"
            "hvd.init()\n"
            "if rank == '1' and sys.argv[1] == 'raise':\n"
            "    raise ValueError('the root cause, in rank 1')\n"
            "if rank == '1':\n"
            "    sys.exit(0)\n"
            "hvd.allreduce(tf.constant(1.0))\n")
    for how, cause in (("raise", " after worker rank 1 raised 'ValueError: the root cause, "
                                 "in rank 1', the cause. Its last output:\n"),
                       ("exit", ": another worker failed, or had already finished its script")):
        launcher = Launcher("-np", "2", "--servers", "1", "--", "python", "-c", code, how,
                            mark=mark)
        assert launcher.wait() == 1, launcher.output()
        report = "\n".join(launcher.err)
        assert "worker rank 0 exited with code 1 first" in report, report
        assert f"worker rank 0 failed because a collective lost a peer{cause}" in report, report


@pytest.mark.multiprocess
def test_a_killed_worker_stops_the_job_with_its_last_output(mark):
    launcher = Launcher("-np", "2", "--servers", "1", "--", "python", PROBE, "--sleep", "60",
                        mark=mark)
    victim = next(p for p in launcher.wait_for_probes(2) if p["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    assert launcher.wait(timeout=60) != 0, launcher.output()
    report = "\n".join(launcher.err)
    assert "worker rank 1 exited with code" in report, report
    assert "[1] {\"probe\": 1" in report, report
    assert all(port_closed(a) for a in victim["addresses"])


@pytest.mark.multiprocess
def test_single_worker_through_the_api_returns_its_exit_code():
    config = LaunchConfig(num_workers=1, num_servers=1, command=(PROBE, "--exit", "5"))
    assert run(config) == 5


@pytest.mark.multiprocess
def test_external_servers_are_used_and_left_running(mark):
    with LocalCluster(2) as cluster:
        launcher = Launcher("--servers", "0", "--ps-addresses", ",".join(cluster.addresses),
                            "--run-id", "ext", PROBE, mark=mark)
        assert launcher.wait() == 0, launcher.output()
        [probe] = launcher.probes()
        assert probe["addresses"] == cluster.addresses and probe["run_id"] == "ext"
        assert probe["size"] == 1 and "(external)" in launcher.start_line()
        assert all(s.proc.poll() is None for s in cluster.servers)
    assert cluster.exit_codes == [0, 0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum, workers", [(signal.SIGTERM, 2), (signal.SIGINT, 1)])
def test_signal_stops_workers_and_servers(mark, signum, workers):
    launcher = Launcher("-np", str(workers), PROBE, "--sleep", "120", mark=mark)
    probes = launcher.wait_for_probes(workers)
    assert marked_processes(mark)  # the orphan check sees the job while it runs
    launcher.proc.send_signal(signum)
    started = time.monotonic()
    assert launcher.wait(20) == 128 + signum, launcher.output()
    assert not wait_gone(mark), "processes left behind"
    assert time.monotonic() - started < 10
    assert all(port_closed(a) for a in probes[0]["addresses"])
    for probe in probes:
        with pytest.raises(ProcessLookupError):
            os.kill(probe["pid"], 0)


@pytest.mark.multiprocess
def test_a_dead_server_stops_the_job(mark):
    launcher = Launcher("-np", "1", "--servers", "2", PROBE, "--sleep", "120", mark=mark)
    launcher.wait_for_probes(1)
    servers = [pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd]
    assert len(servers) == 2
    os.kill(servers[1], signal.SIGKILL)
    assert launcher.wait(20) == 1, launcher.output()
    message = "\n".join(launcher.err)
    assert "exited with code -9 while the job was running; stopping the workers" in message


@pytest.mark.multiprocess
def test_a_hung_server_is_named_in_one_line(mark):
    """A SIGSTOPped server answers no health check: after --health-timeout the launcher names
    it (index and address), stops the job with exit code 1 and leaves nothing behind (issue
    13, item 10e)."""
    import psutil
    launcher = Launcher("-np", "1", "--servers", "2", "--health-timeout", "2", PROBE,
                        "--sleep", "120", mark=mark)
    [probe] = launcher.wait_for_probes(1)
    servers = sorted(pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd)
    victim = servers[1]
    # The server listens on its gRPC port and on its data port: the address is the gRPC one.
    ports = {c.laddr.port for c in psutil.Process(victim).net_connections("tcp")
             if c.status == psutil.CONN_LISTEN}
    index = next(i for i, a in enumerate(probe["addresses"])
                 if int(a.rsplit(":", 1)[1]) in ports)
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    assert launcher.wait(30) == 1, launcher.output()
    assert time.monotonic() - stopped < 12
    expected = (f"parallax run: parameter server {index} ({probe['addresses'][index]}) has not "
                f"answered a health check for ")
    assert any(line.startswith(expected) for line in launcher.err), launcher.output()
    assert not any("worker rank" in line for line in launcher.err), launcher.output()


@pytest.mark.multiprocess
def test_with_replicas_a_dead_or_hung_server_stops_nothing_until_a_shard_has_no_copy(mark):
    """--replicas 2 over 3 servers: a SIGKILLed server and then a SIGSTOPped one (killed by
    the launcher after --health-timeout) leave the job running while every shard keeps a
    copy; a third loss ends it as without copies."""
    launcher = Launcher("-np", "1", "--servers", "4", "--replicas", "2", "--health-timeout",
                        "2", PROBE, "--sleep", "120", mark=mark)
    [probe] = launcher.wait_for_probes(1)
    assert probe["replicas"] == "2", probe
    servers = sorted(pid for pid, cmd in marked_processes(mark).items() if "parallax_ps" in cmd)
    assert len(servers) == 4
    os.kill(servers[0], signal.SIGKILL)
    os.kill(servers[2], signal.SIGSTOP)  # not a neighbour of the first (mod 4)
    deadline = time.monotonic() + 30
    while sum("its copies" in line or "its shards go on" in line for line in launcher.err) < 3:
        assert launcher.proc.poll() is None, launcher.output()
        assert time.monotonic() < deadline, launcher.output()
        time.sleep(0.1)
    assert any("is stopped (SIGKILL) and its copies take over" in line
               for line in launcher.err), launcher.output()
    os.kill(servers[1], signal.SIGKILL)  # both copies of server 0's shards gone
    assert launcher.wait(20) == 1, launcher.output()
    assert "exited with code -9 while the job was running; stopping the workers" in \
        "\n".join(launcher.err)


@pytest.mark.multiprocess
def test_hosts_file_on_this_machine_places_workers_and_servers(mark, tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("server_port: 7391\nhosts:\n  - {host: 127.0.0.1, slots: 2, servers: 2}\n")
    launcher = Launcher("--hosts", str(hosts), PROBE, mark=mark)  # -np: every slot
    assert launcher.wait() == 0, launcher.output()
    probes = launcher.probes()
    assert sorted(p["rank"] for p in probes) == [0, 1], launcher.output()
    assert probes[0]["addresses"] == ["127.0.0.1:7391", "127.0.0.1:7392"]
    assert all(port_closed(a) for a in probes[0]["addresses"])


@pytest.mark.horovod
@pytest.mark.multiprocess
def test_horovodrun_host_string_places_workers_and_one_server(mark):
    """`-H localhost:2`, horovodrun's syntax: 2 workers and one server (at a free port) on
    this machine; --log-level reaches the workers; --horovodrun-arg reaches horovodrun."""
    launcher = Launcher("-H", "localhost:2", "--log-level", "warning",
                        "--horovodrun-arg=--start-timeout=90", PROBE, mark=mark)
    assert launcher.wait() == 0, launcher.output()
    probes = launcher.probes()
    assert sorted(p["rank"] for p in probes) == [0, 1], launcher.output()
    assert len(probes[0]["addresses"]) == 1 and probes[0]["addresses"][0].startswith("localhost:")
    assert {p["log_level"] for p in probes} == {"warning"} and probes[0]["cuda"] is None
    assert all(port_closed(a) for a in probes[0]["addresses"])


@pytest.mark.multiprocess
def test_slot_ids_of_a_host_file_are_each_workers_gpu(mark, tmp_path, cluster):
    """`127.0.0.1: 2,3`: rank 0 (local rank 0) gets GPU 2, rank 1 GPU 3 (CUDA_VISIBLE_DEVICES);
    the servers are the fixture's (a host file's own would take the fixed port 7000)."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("127.0.0.1: 2,3\n")
    launcher = Launcher("--hosts", str(hosts), "--ps-addresses", ",".join(cluster.addresses),
                        PROBE, mark=mark)
    assert launcher.wait() == 0, launcher.output()
    assert {p["rank"]: p["cuda"] for p in launcher.probes()} == {0: "2", 1: "3"}, \
        launcher.output()


NOISY_WORKER = """import sys
sys.stderr.write(
    "2026-12-01 06:40:08.830848: E external/local_xla/xla/stream_executor/cuda/cuda_fft.cc:485]"
    " Unable to register cuFFT factory: Attempting to register factory for plugin cuFFT when"
    " one has already been registered\\n"
    "2026-12-01 06:43:59.060657: I external/local_xla/xla/tsl/cuda/cudart_stub.cc:32] Could not"
    " find cuda drivers on your machine, GPU will not be used.\\n"
    "my own line: Unable to register cuDNN factory\\n")
print("stdout line", flush=True)
"""


@pytest.mark.parametrize("workers", ["1", "2"])
def test_tensorflows_start_up_noise_is_dropped_from_the_workers_output(mark, tmp_path,
                                                                      workers):
    script = tmp_path / "noisy.py"
    script.write_text(NOISY_WORKER)
    launcher = Launcher("-np", workers, "--servers", "1", str(script), mark=mark)
    assert launcher.wait() == 0, launcher.output()
    text = launcher.output()
    assert "Unable to register cuFFT" not in text and "cuda drivers" not in text, text
    assert text.count("my own line: Unable to register cuDNN factory") == int(workers), text
    assert text.count("stdout line") == int(workers), text


def test_parse_args_takes_horovodruns_flags(tmp_path):
    config = parse_args(["-H", "localhost:2,127.0.0.1:1", "--horovodrun-arg=--verbose",
                         "--horovodrun-arg", "--start-timeout 90", "train.py"])
    assert (config.hosts, config.num_workers, config.num_servers) == \
        ("localhost:2,127.0.0.1:1", 3, 2)
    assert config.horovodrun_args == ("--verbose", "--start-timeout", "90")
    assert parse_args(["--hosts", "localhost:2", "train.py"]).hosts == "localhost:2"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=3\n")
    config = parse_args(["--hostfile", str(hostfile), "--log-level", "DEBUG", "train.py"])
    assert (config.hosts, config.num_workers, config.num_servers, config.log_level) == \
        (str(hostfile), 3, 1, "debug")


@pytest.mark.horovod
def test_workers_argv_passes_horovodrun_args_before_the_program():
    config = LaunchConfig(num_workers=2, hosts="localhost:2", command=(PROBE,),
                          horovodrun_args=("--start-timeout", "90"))
    argv, backend = workers_argv(config, validate(config))
    assert backend.name == "horovodrun"
    tail = argv[argv.index("-np"):]
    assert tail == ["-np", "2", "-H", "localhost:2", "--gloo", "--start-timeout", "90",
                    sys.executable, PROBE]
    single = LaunchConfig(command=(PROBE,), horovodrun_args=("--verbose",))
    argv, backend = workers_argv(single, validate(single))
    assert (argv, backend.name) == ([sys.executable, PROBE], "single")


def test_server_start_timeout_and_horovodruns_flag_is_refused_naming_both(capsys):
    assert parse_args(["--server-start-timeout", "5", "t.py"]).start_timeout == 5
    assert parse_args(["t.py"]).start_timeout == 60
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"--start-timeout 7: for the servers' start, give "
                       r"--server-start-timeout 7; for horovodrun's \(the workers'\), "
                       r"--horovodrun-arg=--start-timeout=7"):
        parse_args(["--start-timeout", "7", "t.py"])


@pytest.mark.parametrize("text, args, words", [
    ("127.0.0.1 slots=1\n", ["-np", "2"], "-np 2: "),
    ("127.0.0.1 slots=1\n", ["--servers", "2"], "--servers 2 with --hosts"),
    ("a\na slots=2\n", [], "line 2: host 'a' is listed again"),
])
def test_bad_hosts_input_is_refused(mark, tmp_path, text, args, words):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(text)
    launcher = Launcher("--hosts", str(hosts), *args, PROBE, mark=mark)
    assert launcher.wait(30) == 2, launcher.output()
    assert words in "\n".join(launcher.err), launcher.output()


@pytest.mark.parametrize("fields, words", [
    ({"num_workers": 0}, "-np 0"),
    ({"command": ()}, "no command to run"),
    ({"command": ("missing.py",)}, "script 'missing.py' not found"),
    ({"command": ("python", "missing.py")}, "script 'missing.py' not found"),
    ({"command": ("no-such-program-xyz",)}, "'no-such-program-xyz' is neither"),
    ({"num_servers": 0}, "--servers 0 needs --ps-addresses"),
    ({"num_servers": 0, "ps_addresses": ("localhost",)}, "'localhost' is not host:port"),
    ({"num_servers": 0, "ps_addresses": ("h:70000",)}, "'h:70000' is not host:port"),
    ({"ps_addresses": ("h:7000",)}, "use --servers 0 with --ps-addresses"),
    ({"run_id": "a b"}, "--run-id 'a b'"),
    ({"server_args": ("--port=5000",)}, "drop it"),
    ({"start_timeout": 0}, "--server-start-timeout 0"),
    ({"horovodrun_args": ("-np", "3")}, "--horovodrun-arg '-np': parallax run sets -np itself; "
                                        "give parallax run -np N"),
    ({"horovodrun_args": ("--hostfile=h",)}, "give parallax run -H host:N,... or --hostfile"),
    ({"horovodrun_args": "--verbose"}, "horovodrun_args must be a tuple of strings"),
    ({"command": "train.py"}, "command must be a tuple of strings"),
    ({"mode": "mirrored"}, "--mode 'mirrored' must be one of hybrid, ps, allreduce"),
    ({"metrics_port": 65534}, "--metrics-port 65534: give 0 (free ports) or a port in 1-65533 "
                              "(server i of a machine listens on PORT+i, then its worker of "
                              "local rank j on PORT+2+j)"),
    ({"metrics_port": 0, "server_args": ("--metrics-port=9100",)},
     "--metrics-port sets the servers' metrics ports; drop one of them"),
    ({"metrics_port": 0, "secure": True}, "--metrics-port with --secure"),
])
def test_bad_config_is_refused_before_anything_starts(fields, words):
    config = LaunchConfig(**{"command": (PROBE,), **fields})
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert words in str(info.value)
    with pytest.raises(ConfigError):
        run(config)


def test_metrics_ports_are_checked_against_one_machines_servers_and_their_ports(tmp_path):
    """With a host file, PORT+i is per machine (not per job: its servers, then its workers)
    and must stay clear of the servers' own ports (server_port+i), or a server would start
    half-bound."""
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("server_port: 7000\nhosts:\n- {host: localhost, slots: 1, servers: 2}\n"
                     "- {host: 127.0.0.2, slots: 1, servers: 2}\n")
    base = {"command": (PROBE,), "hosts": str(hosts), "num_servers": 4}
    with pytest.raises(ConfigError, match=r"ports 7001-7003 overlap the servers' own ports "
                                          r"7000-7001"):
        validate(LaunchConfig(**base, metrics_port=7001))
    validate(LaunchConfig(**base, metrics_port=65533))  # 3 a machine, not 6 a job
    with pytest.raises(ConfigError, match=r"a port in 1-65533"):
        validate(LaunchConfig(**base, metrics_port=65534))


def test_worker_metrics_ports_follow_the_servers_of_their_machine(tmp_path):
    """The workers get the port after their machine's servers (local rank j adds j), free
    ones with 0, every interface only where workers run on other hosts; with --ps-addresses
    the workers alone serve metrics, from PORT."""
    def env(**fields):
        config = LaunchConfig(**{"command": (PROBE,), **fields})
        validate(config)
        return worker_metrics_env(config)
    assert env() == {}
    assert env(metrics_port=9100) == {"PARALLAX_WORKER_METRICS_PORT": "9102"}
    assert env(metrics_port=0, num_workers=2) == {"PARALLAX_WORKER_METRICS_PORT": "0"}
    assert env(metrics_port=9100, num_servers=0, ps_addresses=("127.0.0.1:1",)) == {
        "PARALLAX_WORKER_METRICS_PORT": "9100"}
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n- {host: localhost, slots: 2, servers: 1}\n"
                     "- {host: 10.9.9.9, slots: 2, servers: 1}\n")
    assert env(metrics_port=9100, hosts=str(hosts), num_servers=2) == {
        "PARALLAX_WORKER_METRICS_PORT": "9101", "PARALLAX_WORKER_METRICS_HOST": "0.0.0.0"}


@pytest.mark.parametrize("args, code, words", [
    (["-np", "0", PROBE], 2, "-np 0: the number of workers must be at least 1"),
    (["--ps-addresses", "nohost", PROBE], 2, "'nohost' is not host:port"),
    (["missing.py"], 2, "script 'missing.py' not found"),
    ([], 2, "no command to run"),
    (["-np", "x", PROBE], 2, "invalid int value: 'x'"),
    (["--mode", "sync", PROBE], 2, "invalid choice: 'sync'"),
    (["--ps-addresses", "127.0.0.1:1", "--server-start-timeout", "0.5", PROBE], 1,
     "not serving"),
    (["--log-level", "loud", PROBE], 2, "argument --log-level: invalid choice: 'loud'"),
    (["-H", "localhost:2", "--hostfile", "h.txt", PROBE], 2, "both given; give one"),
    (["--hosts", "nohost", PROBE], 2, "--hosts nohost: cannot read it"),
])
def test_cli_reports_bad_input(mark, args, code, words):
    launcher = Launcher(*args, mark=mark)
    assert launcher.wait(30) == code, launcher.output()
    assert words in "\n".join(launcher.err), launcher.output()
    assert not launcher.probes()


def _free_port_pair() -> int:
    """A port P with P and P+1 free (for two servers' metrics at P and P+1)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two consecutive free ports")


SCRAPE = ("import sys, urllib.request\n"
          "for port in sys.argv[1:]:\n"
          "    text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10)"
          ".read().decode()\n"
          "    print('SCRAPED', port, 'parallax_up 1.0' in text, flush=True)\n")


@pytest.mark.multiprocess
def test_metrics_ports_are_each_servers_own_and_printed(mark):
    """--metrics-port P: server i of this machine serves /metrics at P+i (no clash between
    local servers), and the launcher prints where; 0 picks free ports."""
    port = _free_port_pair()
    launcher = Launcher("--servers", "2", "--metrics-port", str(port), "--", sys.executable,
                        "-c", SCRAPE, str(port), str(port + 1), mark=mark)
    assert launcher.wait() == 0, launcher.output()
    assert f"SCRAPED {port} True" in launcher.out and f"SCRAPED {port + 1} True" in \
        launcher.out, launcher.output()
    assert (f"parallax run: metrics: server 0 at http://127.0.0.1:{port}/metrics, server 1 "
            f"at http://127.0.0.1:{port + 1}/metrics") in launcher.err, launcher.output()
    picked = Launcher("--servers", "2", "--metrics-port", "0", "--", sys.executable, "-c",
                      "pass", mark=mark)
    assert picked.wait() == 0, picked.output()
    line = next(line for line in picked.err if "metrics: " in line)
    ports = re.findall(r"http://127\.0\.0\.1:(\d+)/metrics", line)
    assert len(set(ports)) == 2 and "0" not in ports, line


@pytest.mark.multiprocess
def test_a_clash_of_fixed_metrics_ports_names_the_servers_reason(mark):
    """One fixed port for every server (--server-arg): the second cannot bind, and the
    launcher says it exited, with the server's own reason, not that it timed out."""
    port = _free_port_pair()
    launcher = Launcher("--servers", "2", f"--server-arg=--metrics-port={port}", "--",
                        sys.executable, "-c", "pass", mark=mark)
    assert launcher.wait() == 1, launcher.output()
    err = "\n".join(launcher.err)
    assert re.search(r"parameter server [01] exited with code 2 before it was ready", err), err
    assert f"cannot serve metrics on 127.0.0.1:{port} (Address already in use)" in err, err


@pytest.mark.multiprocess
def test_job_progress_lines_come_from_the_servers(mark, cluster):
    """The launcher reads the job's tables from the servers; a table of another job (another
    run id prefix) is not reported."""
    from parallax.launch.progress import ProgressReporter
    from parallax.protocol.specs import TableSpec

    run_id = f"prog{uuid.uuid4().hex[:6]}"
    lines: list[str] = []
    reporter = ProgressReporter(cluster.addresses, run_id, 0, lines.append)
    assert "no tables on the servers yet" in reporter.snapshot()
    with parallax.PSClient(cluster.addresses) as client:
        table = client.create_table(TableSpec(f"{run_id}.v0.words", dim=4, vocabulary_size=50,
                                              shard_count=2))
        client.create_table(TableSpec(f"x{run_id}.v0.other", dim=4, vocabulary_size=50))
        for step in range(3):
            table.pull([1, 2, 3], min_step=step)
            table.push([1, 2, 3], np.ones((3, 4), np.float32), step=step)
    line = reporter.snapshot()
    assert "words step 3" in line and "other" not in line, line
    assert "rows pulled 9, pushed 9" in line, line
    launcher = Launcher("-np", "1", "--servers", "1", "--progress-seconds", "0.5", "--",
                        "python", PROBE, "--sleep", "3", mark=mark)
    assert launcher.wait() == 0, launcher.output()
    assert any("progress 0m0" in line for line in launcher.err), launcher.output()
