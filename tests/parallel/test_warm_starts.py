"""Warm starts (`parallax.launch.warm`): a worker forked from the warm process behaves as the
same command started cold would, and the launcher's guarantees (no orphans, signals, exit
codes) hold for it.

Most cases run the stub (`warm_stub.py`) against one warm process shared by the module (its
start imports TensorFlow, ~3 s) and compare with the command run cold; those about the
launcher run `parallax run --warm-starts on`, with the orphan check of
tests/helpers/launching.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from parallax.launch.warm import warm_process
from launching import Launcher, wait_gone
from launching import mark  # noqa: F401 (a fixture)

WARM_EVIDENCE = "import sys; print('warm' if 'tensorflow' in sys.modules else 'cold', flush=True)"


@pytest.fixture(scope="module")
def warm():
    with warm_process(True, dict(os.environ), lambda message: None) as warm:
        warm.ensure()
        deadline = time.monotonic() + 30
        while not Path(warm.socket).exists():  # bound before its imports: stubs then wait
            assert time.monotonic() < deadline, "the warm process did not listen"
            time.sleep(0.02)
        yield warm


def _script(tmp_path, text: str, name: str = "main.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)


def _both(warm, program: list[str], **kwargs):
    """(warm, cold) results of `program`."""
    return _run(warm.wrap(program), **kwargs), _run(program, **kwargs)


FAILING = f"""
{WARM_EVIDENCE}
def inner():
    raise ValueError("boom")
inner()
"""


def test_an_uncaught_exceptions_traceback_is_the_programs_only(warm, tmp_path):
    # defect: three "<frozen runpy>" frames led it (runpy is frozen: its frames do not name
    # runpy.__file__, which the filter compared with)
    script = _script(tmp_path, FAILING)
    hot, cold = _both(warm, [sys.executable, script])
    assert hot.stdout == "warm\n" and cold.stdout == "cold\n"
    assert (hot.returncode, hot.stderr) == (cold.returncode, cold.stderr) == (1, cold.stderr)
    assert "runpy" not in hot.stderr


def test_a_modules_uncaught_exception_too(warm, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    _script(tmp_path / "pkg", FAILING, "job.py")
    hot, cold = _both(warm, [sys.executable, "-m", "pkg.job"], cwd=tmp_path)
    assert hot.stdout == "warm\n"
    # (`python -m` shows two frames of runpy's own; the warm worker shows none of it)
    ours = "".join(line for line in cold.stderr.splitlines(True) if "frozen runpy" not in line)
    assert (hot.returncode, hot.stderr) == (cold.returncode, ours)


def test_the_programs_excepthook_reports_an_uncaught_exception(warm, tmp_path):
    # defect: the warm worker printed the traceback itself; sys.excepthook was never called
    script = _script(tmp_path, f"""
        {WARM_EVIDENCE}
        import sys
        sys.excepthook = lambda kind, exc, tb: print("hooked", kind.__name__, exc)
        raise ValueError("boom")
        """)
    hot, cold = _both(warm, [sys.executable, script])
    assert hot.stdout == "warm\nhooked ValueError boom\n", hot.stderr
    assert (hot.returncode, hot.stdout[5:]) == (cold.returncode, cold.stdout[5:])


def test_a_keyboard_interrupt_runs_the_exits_work_then_ends_by_sigint(warm, tmp_path):
    # defect: the worker killed itself with SIGINT at once: no atexit handler ran, and a
    # non-daemon thread's last output was lost
    script = _script(tmp_path, f"""
        {WARM_EVIDENCE}
        import atexit, sys, threading, time
        atexit.register(lambda: print("atexit ran"))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended"))).start()
        sys.stdout.write("partial ")
        raise KeyboardInterrupt
        """)
    hot, cold = _both(warm, [sys.executable, script])
    assert hot.stdout == "warm\npartial thread ended\natexit ran\n", hot.stderr
    assert (hot.returncode, hot.stdout[5:]) == (cold.returncode, cold.stdout[5:])
    assert hot.returncode == -signal.SIGINT
    assert hot.stderr.endswith("KeyboardInterrupt\n") and "runpy" not in hot.stderr


GROUPED = f"""
{WARM_EVIDENCE}
import os
print(os.getpid() == os.getpgid(0) == os.getsid(0), flush=True)
"""


def test_a_warm_worker_leads_its_own_session_and_process_group(warm, tmp_path):
    # defect: every warm worker was in the warm process's group, so a worker's
    # os.killpg(0, ...) (its own children, it meant) reached the other workers and the warm
    # process too
    hot = _run(warm.wrap([sys.executable, _script(tmp_path, GROUPED)]))
    assert hot.returncode == 0 and hot.stdout.split() == ["warm", "True"], hot


CLOSES_ALL = f"""
{WARM_EVIDENCE}
import os, threading, time
os.closerange(3, 65536)  # as a daemonizing library does
time.sleep(0.5)
print("threads", threading.active_count(), flush=True)
"""


def test_a_warm_worker_that_closes_every_descriptor_runs_on_as_a_cold_one(warm, tmp_path):
    # defect: a warm worker watched its stub's connection from a thread of its own: closing
    # every descriptor closed it and killed the worker (SIGKILL), and the thread was one
    # more than a cold worker's
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, CLOSES_ALL)])
    assert hot.returncode == cold.returncode == 0, (hot, cold)
    assert hot.stdout.split() == ["warm", "threads", "1"], hot
    assert cold.stdout.split() == ["cold", "threads", "1"], cold


def test_a_killed_stubs_worker_is_killed(warm, tmp_path):
    pid_file = tmp_path / "pid"
    script = _script(tmp_path, f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(600)
        """)
    stub = subprocess.Popen(warm.wrap([sys.executable, script]))
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and stub.poll() is None, "the worker did not start"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert worker != stub.pid  # (forked by the warm process, not exec'd by the stub)
        stub.kill()
        stub.wait()
        assert _gone(worker, 5), "the worker outlived its stub"
    finally:
        stub.kill()
        stub.wait()


def _gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_module_imported_warm_that_the_scripts_directory_has_starts_cold(warm, tmp_path):
    # defect: only the five preloaded packages were checked; `import secrets` got the
    # standard library's (imported by the preloads), not the script's secrets.py
    (tmp_path / "secrets.py").write_text("TOKEN = 'mine'\n")
    script = _script(tmp_path, f"""
        {WARM_EVIDENCE}
        import secrets
        print(secrets.TOKEN)
        """)
    hot = _run(warm.wrap([sys.executable, script]),
               env={**os.environ, "PARALLAX_WARM_DEBUG": "1"})
    assert hot.stdout == "cold\nmine\n", hot.stderr
    assert f"{tmp_path} has a secrets of its own" in hot.stderr


def test_a_script_whose_directory_shadows_nothing_starts_warm(warm, tmp_path):
    (tmp_path / "helpers.py").write_text("X = 1\n")
    script = _script(tmp_path, f"{WARM_EVIDENCE}\nimport helpers\nprint(helpers.X)\n")
    assert _run(warm.wrap([sys.executable, script])).stdout == "warm\n1\n"


CHILD = f"""
{WARM_EVIDENCE}
import os, subprocess, time
subprocess.Popen(["sleep", "600"])
print("child started", flush=True)
time.sleep(600)
"""


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_warm_workers_children_end_when_parallax_run_is_sigkilled(mark, tmp_path):
    # defect: the workers died with the warm process, their children (a worker's
    # subprocesses, multiprocessing's) lived on, re-parented to init: they were in no
    # group or subreaper of the launcher's
    launcher = _two_warm_workers(mark, tmp_path, CHILD, "child started")
    launcher.proc.kill()
    launcher.wait(10)
    left = wait_gone(mark, 15)
    assert not left, f"left behind: {left}"


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_warm_workers_children_end_with_the_launcher(mark, tmp_path):
    launcher = _two_warm_workers(mark, tmp_path, CHILD, "child started")
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(30) == 128 + signal.SIGTERM, launcher.output()
    assert not wait_gone(mark, 5)


DETACHED = f"""
{WARM_EVIDENCE}
import subprocess
subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)  # holds none of the worker's output
"""


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("warm_starts", ["on", "off"])
def test_a_workers_detached_children_end_with_the_job(mark, tmp_path, warm_starts):
    # defect: a worker's child that holds none of its output outlived a job that ended
    # normally. Warm: the warm process's group caught it until each warm worker led a
    # session of its own (os.setsid); cold: it was never caught (re-parented to the job's
    # subreaper, which exited with horovodrun, then to init)
    launcher = Launcher("-np", "2", "--warm-starts", warm_starts, "--", sys.executable,
                        _script(tmp_path, DETACHED), mark=mark)
    assert launcher.wait(120) == 0, launcher.output()
    assert sum(line.endswith("warm") for line in launcher.out) == (
        2 if warm_starts == "on" else 0), launcher.output()
    left = wait_gone(mark, 5)
    assert not left, f"left behind: {left}"


SLEEPER = f"""
{WARM_EVIDENCE}
import time
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_terminals_ctrl_c_reaches_the_launcher_not_the_warm_workers(mark, tmp_path):
    # defect: the warm process and its workers were in the launcher's process group, the
    # terminal's foreground group: Ctrl-C interrupted each worker directly (KeyboardInterrupt
    # tracebacks) and killed the warm process, whose death killed them; cold workers run in
    # sessions of horovodrun's and hear of it from the launcher only
    launcher = _two_warm_workers(mark, tmp_path, SLEEPER, "ready", start_new_session=True)
    os.killpg(launcher.proc.pid, signal.SIGINT)  # what the terminal does
    assert launcher.wait(30) == 128 + signal.SIGINT, launcher.output()
    assert "KeyboardInterrupt" not in launcher.output()
    assert "warm process ended" not in launcher.output()


def _two_warm_workers(mark: str, tmp_path: Path, body: str, ready: str,
                      **options) -> Launcher:
    """`parallax run -np 2 --warm-starts on` of a script `body`, once both workers printed
    `ready`, checked to be warm."""
    launcher = Launcher("-np", "2", "--warm-starts", "on", "--", sys.executable,
                        _script(tmp_path, body), mark=mark, **options)
    _wait_lines(launcher, ready, 2)
    assert sum("warm" in line for line in launcher.out) == 2, launcher.output()
    return launcher


def _wait_lines(launcher: Launcher, text: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(text in line for line in launcher.out) < count:
        assert launcher.proc.poll() is None, f"launcher exited early:\n{launcher.output()}"
        assert time.monotonic() < deadline, f"no {count} {text!r}:\n{launcher.output()}"
        time.sleep(0.05)


def test_the_first_worker_of_a_single_worker_job_starts_warm(tmp_path, mark):
    """The one worker of `-np 1` is started at once, with no horovodrun before it: the
    launcher waits for the warm process to listen (it binds before its imports), so that
    worker does not come too early and start cold."""
    from parallax.client.local_cluster import LocalCluster
    script = tmp_path / "probe.py"
    script.write_text("import sys\nprint('warm' if 'tensorflow' in sys.modules else 'cold')\n")
    with LocalCluster(1) as cluster:  # servers already up: nothing started before the worker
        launcher = Launcher("--warm-starts", "on", "--servers", "0", "--ps-addresses",
                            cluster.addresses[0], "--", sys.executable, str(script), mark=mark)
        assert launcher.wait(120) == 0, launcher.output()
    assert "warm" in launcher.out, launcher.output()
