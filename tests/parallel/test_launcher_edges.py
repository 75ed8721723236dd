"""`parallax run`'s edges: the interpreter horovodrun's code runs with (pip's /bin/sh
wrappers), restarts of servers on other hosts without --data-dir, and how a worker command is
started so that it dies with the launcher (no Python in a fork of the threaded launcher).

Real files, interpreters and processes; Horovod's presence is hidden by sys.modules where a
case needs a launcher whose Python lacks it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parallax.errors import ConfigError
from parallax.launch.backends.horovodrun import bound_horovodrun
from parallax.launch.run import LaunchConfig, validate

from launching import PROBE
# what pip writes for a console script when the environment's path is long or has spaces
PIP_SH_WRAPPER = """#!/bin/sh
'''exec' "{python}" "$0" "$@"
' '''
import sys
from horovod.runner.launch import run_commandline
if __name__ == '__main__':
    sys.exit(run_commandline())
"""


def _horovodrun(tmp_path: Path, python: str, text: str = PIP_SH_WRAPPER) -> str:
    script = tmp_path / "my venv" / "bin" / "horovodrun"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text.format(python=python))
    script.chmod(0o755)
    return str(script)


def _hidden_horovod(monkeypatch) -> None:
    """This (the launcher's) Python cannot find Horovod."""
    monkeypatch.setitem(sys.modules, "horovod", None)


# ---- horovodrun's interpreter ------------------------------------------------------------
def test_pip_sh_wrapped_horovodrun_runs_through_its_python(tmp_path):
    script = _horovodrun(tmp_path, sys.executable)
    argv = bound_horovodrun([script, "--version"])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip(), (argv, done.stdout, done.stderr)


def test_without_horovod_here_the_python_of_pips_wrapper_is_used(tmp_path, monkeypatch):
    python = str(Path(sys.executable).parent / f"python{sys.version_info[0]}.{sys.version_info[1]}")
    assert Path(python).is_file()
    script = _horovodrun(tmp_path, python)
    _hidden_horovod(monkeypatch)
    assert bound_horovodrun([script, "-np", "2"])[0] == python


@pytest.mark.parametrize("text", [PIP_SH_WRAPPER, "#!{python}\n"], ids=["sh", "shebang"])
def test_horovodrun_whose_interpreter_is_no_python_with_horovod_is_refused(tmp_path,
                                                                           monkeypatch, text):
    script = _horovodrun(tmp_path, "/bin/cat", text)
    _hidden_horovod(monkeypatch)
    with pytest.raises(ConfigError, match=r"runs with /bin/cat, which cannot import Horovod.*"
                                          r"install Horovod"):
        bound_horovodrun([script, "-np", "2"])


# ---- restarts of servers elsewhere ----------------------------------------------------------
def _hosts(tmp_path: Path, *hosts: str) -> str:
    path = tmp_path / "hosts.yaml"
    path.write_text("hosts:\n" + "".join(f"  - {{host: '{h}', slots: 1}}\n" for h in hosts))
    return str(path)


def test_restarts_of_servers_on_other_hosts_need_a_data_dir(tmp_path):
    hosts = _hosts(tmp_path, "localhost", "192.0.2.1")  # TEST-NET-1: not this machine
    config = LaunchConfig(num_workers=2, hosts=hosts, max_restarts=1, command=(PROBE,))
    with pytest.raises(ConfigError, match=r"--max-restarts 1 without --data-dir.*192\.0\.2\.1"
                                          r".*give --data-dir on storage that every server"):
        validate(config)
    for fine in (LaunchConfig(num_workers=2, hosts=hosts, max_restarts=1, command=(PROBE,),
                              data_dir=str(tmp_path / "shared")),
                 LaunchConfig(num_workers=2, hosts=hosts, command=(PROBE,)),
                 LaunchConfig(num_workers=2, hosts=_hosts(tmp_path, "localhost", "127.0.0.1"),
                              max_restarts=1, command=(PROBE,))):
        validate(fine)


# ---- the worker command dies with the launcher, without a preexec_fn --------------------------
AT_FORK = """
import os, sys, threading, time
from parallax.launch import run as launch
from parallax.launch.backends import BACKENDS
marker = sys.argv[1]
os.register_at_fork(after_in_child=lambda: open(marker, "a").write("python ran in the fork\\n"))
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a threaded launcher
job = launch._Job(["grep", "SigIgn", "/proc/self/status"], dict(os.environ), BACKENDS["single"])
print("exit", job.proc.wait())
"""
SIGPIPE_BIT = 1 << 12  # of /proc's SigIgn mask: signal 13


def test_worker_command_starts_without_python_in_a_fork_of_the_launcher(tmp_path):
    marker = tmp_path / "forked"
    done = subprocess.run([sys.executable, "-c", AT_FORK, str(marker)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "exit 0" in done.stdout, (done.stdout, done.stderr)
    assert not marker.exists(), marker.read_text()  # no Python ran in a fork of the launcher
    ignored = int(done.stdout.split("SigIgn:")[1].split()[0], 16)
    assert not ignored & SIGPIPE_BIT, done.stdout  # the command gets SIGPIPE, as from a shell


# ---- the first failure a backend reports stays the first -------------------------------------
def test_first_reported_failure_is_kept_while_the_other_stream_is_read():
    """horovodrun reports failures on stdout while the failed worker's traceback arrives on
    stderr: a line read on stderr meanwhile must not unset the failure stdout recorded, or
    the job blames the worker horovodrun killed afterwards (exit 143) instead."""
    import os
    import time

    from parallax.launch.backends.horovodrun import Horovodrun
    from parallax.launch.run import _Job

    class SlowToRead(Horovodrun):
        def failure(self, line):
            if line == b"traceback":
                time.sleep(0.3)  # stdout's report is recorded meanwhile
            return super().failure(line)

    script = ("echo traceback >&2; echo 'Process 1 exit with status code 3.'; sleep 0.6; "
              "echo 'Process 0 exit with status code 143.'; exit 1")
    job = _Job(["sh", "-c", script], dict(os.environ), SlowToRead())
    job.proc.wait(30)
    job.stop(grace=5.0)
    assert job.first_failure == (1, 3)
    assert job.exit_code() == 3


# ---- the launcher's working directory is the workers', not its children's sys.path -----------
@pytest.mark.parametrize("collectives", ["horovod", "tensorflow"])
def test_a_numpy_directory_where_the_job_starts_breaks_none_of_parallaxs_processes(
        tmp_path, collectives):
    # defect: the servers (`python -m parallax_ps`) and the TensorFlow supervisor
    # (`python -m ...tf_supervisor`) had the launcher's working directory first on their
    # sys.path, as -m puts it there: a numpy/ (or parallax/) of the user's project there was
    # imported instead, and they died at start
    for package in ("numpy", "parallax"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('my {package}')\n")
    parallax = Path(sys.executable).parent / "parallax"  # the console script, as users run it
    done = subprocess.run([str(parallax), "run", "-np", "2", "--servers", "1",
                           "--collectives", collectives, "--progress-seconds", "0", "--",
                           sys.executable, "-c", "print('worker ran')"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert out.count("worker ran") == 2 and "my numpy" not in out, out[-3000:]


@pytest.mark.parametrize("package", ["numpy", "parallax"])
def test_a_numpy_directory_where_the_job_starts_breaks_no_worker_given_its_gpu(
        tmp_path, package):
    # defect: a host file naming GPU ids runs each worker through
    # `python -m parallax.launch.hosts gpus` (its CUDA_VISIBLE_DEVICES), in the job's working
    # directory, first on its sys.path: a numpy/ or parallax/ there was imported instead and
    # every worker died at start (so did `hosts serve`, a TensorFlow worker on another host)
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text(f"raise ImportError('my {package}')\n")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - {host: localhost, gpus: [0, 1]}\n")
    parallax = Path(sys.executable).parent / "parallax"
    done = subprocess.run([str(parallax), "run", "-np", "2", "--hosts", str(hosts),
                           "--collectives", "tensorflow", "--progress-seconds", "0", "--",
                           sys.executable, "-c",
                           "import os; print('worker ran on', os.environ['CUDA_VISIBLE_DEVICES'])"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "worker ran on 0" in out and "worker ran on 1" in out, out[-3000:]


def test_a_server_command_of_the_users_own_keeps_its_scripts_directory_on_sys_path(tmp_path):
    # defect: the servers' PYTHONSAFEPATH=1 (meant for their own `python -m parallax_ps`)
    # reached whatever LocalCluster's `command` (or a remote server's ssh, its ProxyCommand)
    # runs: a Python script there lost its own directory from sys.path
    from parallax.client.local_cluster import SERVER_COMMAND, LocalCluster
    (tmp_path / "site_setup.py").write_text("READY = True\n")
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text("import os, sys, site_setup\n"  # beside it, as a script imports it
                       f"os.execv(sys.executable, [*{list(SERVER_COMMAND)!r}, *sys.argv[1:]])\n")
    with LocalCluster(1, command=(sys.executable, str(wrapper)), start_timeout=60) as cluster:
        assert len(cluster.addresses) == 1


def test_the_supervisors_start_keeps_the_standard_library_before_site_packages(tmp_path):
    # defect: the TensorFlow supervisor's start (tfrun.own_module) put the directory parallax
    # was imported from first on its sys.path; for a parallax installed from a wheel that is
    # site-packages, then ahead of the standard library (a `typing` backport there, say,
    # shadowed the standard library's own)
    import json
    import os
    import sysconfig
    from parallax.launch.module_argv import RUN_MODULE
    (tmp_path / "path_probe.py").write_text("import json, sys; print(json.dumps(sys.path))\n")
    paths = sysconfig.get_paths()
    site_packages, stdlib = os.path.realpath(paths["purelib"]), os.path.realpath(paths["stdlib"])
    done = subprocess.run([sys.executable, "-c", RUN_MODULE, site_packages, "path_probe"],
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    path = [os.path.realpath(p) for p in json.loads(done.stdout)]
    assert path.index(stdlib) < path.index(site_packages), path
    assert str(tmp_path) in path and "" not in json.loads(done.stdout)  # (cwd: not there)
