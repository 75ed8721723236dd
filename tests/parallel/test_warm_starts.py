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
from launching import Launcher, pid_alive, wait_gone
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


DISPOSITIONS = f"""
{WARM_EVIDENCE}
import signal
print([str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                                          signal.SIGTERM)])
"""


def _ignoring() -> None:
    """As nohup (SIGHUP) and a shell's background job (SIGINT, SIGQUIT) start a command."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)


@pytest.mark.parametrize("env", [{}, {"PYTHONWARMREFUSED": "1"}])  # warm; the stub's cold
def test_signals_ignored_where_the_worker_starts_stay_ignored(warm, tmp_path, env):
    # defect: the stub caught them to forward them and the warm worker set them to their
    # defaults (SIGINT: KeyboardInterrupt): `nohup parallax run` workers died of a SIGHUP
    # that cold ones ignore; the stub's cold start reset them to their defaults too
    program = [sys.executable, _script(tmp_path, DISPOSITIONS)]
    hot = _run(warm.wrap(program), preexec_fn=_ignoring, env={**os.environ, **env})
    cold = _run(program, preexec_fn=_ignoring)
    assert hot.stdout == ("cold\n" if env else "warm\n") + cold.stdout[5:], hot.stderr
    assert cold.stdout[5:] == "['1', '1', '1', '0']\n"


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
        if not pid_alive(pid):
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


MAIN_MODULE = f"""
{WARM_EVIDENCE}
import atexit, builtins, pickle, sys, threading, time
class Job:
    pass
def later():
    time.sleep(0.2)
    print("thread pickled", len(pickle.dumps(Job())) > 0, flush=True)
threading.Thread(target=later).start()
atexit.register(lambda: print("atexit pickled", len(pickle.dumps(Job())) > 0))
print(__builtins__ is builtins, type(__loader__).__name__, __file__ == sys.argv[0])
main = sys.modules["__main__"]
print([t.name for t in threading.enumerate()], sys.modules.get("__mp_main__", main) is main)
"""


def test_the_scripts_main_module_outlives_its_body_as_pythons_does(warm, tmp_path):
    # defect: runpy.run_path put the warm process's __main__ back once the script's body
    # returned: its thread and its atexit handler could not pickle its classes ("attribute
    # lookup Job on __main__ failed"); its __builtins__ was a dict, __loader__ None, the
    # warm process's lifeline thread was one of threading.enumerate()'s, and __mp_main__
    # (multiprocessing's alias of __main__) was the warm process's
    script = _script(tmp_path, MAIN_MODULE)
    hot, cold = _both(warm, [sys.executable, script])
    assert hot.stdout.startswith("warm\n"), hot
    assert (hot.returncode, hot.stdout[5:], hot.stderr) == (cold.returncode, cold.stdout[5:],
                                                            cold.stderr)
    assert hot.stdout.endswith("thread pickled True\natexit pickled True\n"), hot.stdout


def test_a_relative_scripts_file_is_joined_to_the_directory_as_pythons_is(warm, tmp_path):
    # defect: its __file__ (and its frames' file names) were normalized: "/d/main.py" for
    # `python ./main.py`, where Python says "/d/./main.py"
    _script(tmp_path, f"{WARM_EVIDENCE}\nimport sys\nprint(__file__, sys.argv[0])\n")
    hot, cold = _both(warm, [sys.executable, "./main.py"], cwd=tmp_path)
    assert hot.stdout == f"warm\n{tmp_path}/./main.py ./main.py\n", hot.stderr
    assert hot.stdout[5:] == cold.stdout[5:]


@pytest.mark.parametrize("program", [["missing.py"], ["-m", "no_such_module_here"],
                                     ["."]])
def test_a_missing_script_or_module_fails_as_pythons_does(warm, tmp_path, program):
    # defect: a mistyped script ended with a FileNotFoundError traceback and exit status 1
    # (Python: "can't open file ...", 2); a missing module or a directory without a
    # __main__.py with runpy's traceback (Python: one line)
    hot, cold = _both(warm, [sys.executable, *program], cwd=tmp_path)
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout,
                                                        cold.stderr)
    assert cold.returncode in (1, 2) and "Traceback" not in hot.stderr


def _debug(**more: str) -> dict[str, str]:
    """The environment now (the warm process's: an earlier test of the session may have set
    a variable read at TensorFlow's import since this module was collected), with the stub's
    reasons for a cold start printed."""
    return {**os.environ, "PARALLAX_WARM_DEBUG": "1", **more}


QUIETED = f"""
{WARM_EVIDENCE}
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
print([int(x) for x in tf.data.Dataset.range(3)])  # (TensorFlow logs "End of sequence")
"""


def test_a_script_that_sets_a_variable_read_at_tensorflows_import_starts_cold(warm, tmp_path):
    # defect: TensorFlow, imported already, had read TF_CPP_MIN_LOG_LEVEL: the script's
    # "3" did not quiet its C++ log (nor would KERAS_BACKEND have picked Keras's backend)
    hot = _run(warm.wrap([sys.executable, _script(tmp_path, QUIETED)]), env=_debug())
    assert hot.stdout == "cold\n[0, 1, 2]\n", hot.stderr
    assert "may set TF_CPP_MIN_LOG_LEVEL" in hot.stderr and "rendezvous" not in hot.stderr


GRPC_TRACED = f"""
{WARM_EVIDENCE}
import os
os.environ["GRPC_VERBOSITY"] = "DEBUG"
os.environ["GRPC_TRACE"] = "api"
import grpc
grpc.insecure_channel("localhost:1").close()
"""


TEMPORARY = f"""
{WARM_EVIDENCE}
import os, tempfile
os.environ["TMPDIR"] = os.path.dirname(os.path.abspath(__file__))
import tensorflow
print(tempfile.gettempdir() == os.environ["TMPDIR"])
"""


def test_a_script_that_sets_tmpdir_before_importing_tensorflow_starts_cold(warm, tmp_path):
    # defect: TensorFlow's import in the warm process had cached tempfile.tempdir ("/tmp"):
    # the script's temporary files went there, not to its TMPDIR
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, TEMPORARY)])
    assert hot.stdout == cold.stdout == "cold\nTrue\n", hot.stderr


def test_a_script_that_sets_grpcs_log_variables_starts_cold(warm, tmp_path):
    # defect: gRPC, imported with parallax, had read GRPC_VERBOSITY and GRPC_TRACE: the
    # script's did nothing (commonly "ERROR", to quiet it)
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, GRPC_TRACED)])
    assert hot.stdout == cold.stdout == "cold\n", hot.stderr
    assert "grpc_channel_create" in hot.stderr and "grpc_channel_create" in cold.stderr


def test_a_script_that_sets_such_a_variable_to_the_value_it_has_starts_warm(warm, tmp_path):
    value = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    setting = (f"os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')" if value is not None
               else "os.environ.get('X')")
    script = _script(tmp_path, f"{WARM_EVIDENCE}\nimport os\n{setting}\n")
    assert _run(warm.wrap([sys.executable, script])).stdout == "warm\n"


@pytest.mark.parametrize("variable, value", [("KERAS_BACKEND", "jax-x"),
                                             ("LC_ALL", "C.UTF-8x")])
def test_a_worker_whose_environment_has_another_such_value_starts_cold(warm, tmp_path,
                                                                       variable, value):
    # defect: its Keras ran on the warm process's backend; its standard streams had the
    # warm process's encoding (LC_ALL, LANG: read as the interpreter starts)
    script = _script(tmp_path, WARM_EVIDENCE)
    hot = _run(warm.wrap([sys.executable, script]), env=_debug(**{variable: value}))
    assert hot.stdout == "cold\n" and f"{variable} is not the warm process's" in hot.stderr


HANDLERS = f"""
{WARM_EVIDENCE}
import sys
import absl.logging
import tensorflow as tf
print([h.stream is sys.stderr for h in tf.get_logger().handlers],
      absl.logging.get_absl_handler().python_handler.stream is sys.stderr)
"""


def test_tensorflows_and_absls_log_handlers_write_to_the_workers_stderr(warm, tmp_path):
    # defect: they held the warm process's sys.stderr (on the same fd, another object): a
    # script that replaced sys.stderr's object, or closed it, parted from them
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, HANDLERS)])
    assert hot.stdout == "warm\n[True] True\n", hot.stderr
    assert hot.stdout[5:] == cold.stdout[5:]


IMPORTED_HERE = f"""
{WARM_EVIDENCE}
import os, multiprocessing.process, keras, rich.traceback
print(multiprocessing.process.ORIGINAL_DIR == os.getcwd(),
      sys.modules["rich"]._IMPORT_CWD == os.getcwd())
"""


def test_the_directory_the_preloads_noted_as_theirs_is_the_workers(warm, tmp_path):
    # defect: multiprocessing's ORIGINAL_DIR (where its spawned children start) and rich's
    # _IMPORT_CWD were the warm process's private directory, removed with the launcher
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, IMPORTED_HERE)], cwd=tmp_path)
    assert hot.stdout == "warm\nTrue True\n", hot.stderr
    assert hot.stdout[5:] == cold.stdout[5:]


CAPTURED = f"""
{WARM_EVIDENCE}
import io, sys
real, sys.stderr = sys.stderr, io.StringIO()
import tensorflow as tf
tf.get_logger().warning("captured")
captured, sys.stderr = sys.stderr.getvalue(), real
print("captured" in captured)
"""


def test_a_script_that_replaces_stderr_before_tensorflows_import_starts_cold(warm, tmp_path):
    # defect: TensorFlow's log handler, made in the warm process, wrote to the real stderr;
    # a cold import makes it on the script's replacement
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, CAPTURED)])
    assert hot.stdout == "cold\nTrue\n" and cold.stdout == "cold\nTrue\n", hot.stderr


STREAMS = f"""
{WARM_EVIDENCE}
import sys
for stream in (sys.stdin, sys.stdout, sys.stderr):
    print(stream.name, stream.mode, stream.write_through, stream.line_buffering,
          stream.buffer.name, stream.encoding, stream.errors)
"""


def test_the_standard_streams_are_named_and_moded_as_pythons(warm, tmp_path):
    # defect: sys.stdout.mode raised AttributeError; names were 0, 1, 2, not "<stdout>"...
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, STREAMS)])
    assert hot.stdout.startswith("warm\n<stdin> r "), hot.stderr
    assert (hot.returncode, hot.stdout[5:], hot.stderr) == (cold.returncode, cold.stdout[5:],
                                                            cold.stderr)


LOGS_FIRST = f"""
{WARM_EVIDENCE}
import logging
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
import tensorflow as tf
tf.get_logger().warning("once")
"""


def test_logging_set_up_before_tensorflows_import_starts_cold(warm, tmp_path):
    # defect: TensorFlow's logger got a handler of its own in the warm process (no root
    # handler then); a cold import after basicConfig adds none: each message came twice
    hot, cold = _both(warm, [sys.executable, _script(tmp_path, LOGS_FIRST)])
    assert hot.stdout == "cold\n", hot.stderr
    assert hot.stderr.count("once") == cold.stderr.count("once") == 1, hot.stderr


def test_logging_set_up_after_tensorflows_import_starts_warm_and_logs_as_cold(warm, tmp_path):
    script = _script(tmp_path, LOGS_FIRST.replace("import tensorflow as tf\n", "").replace(
        "import logging\n", "import logging\nimport tensorflow as tf\n"))
    hot, cold = _both(warm, [sys.executable, script])
    assert hot.stdout == "warm\n", hot.stderr
    assert hot.stderr.count("once") == cold.stderr.count("once") == 2, hot.stderr


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
