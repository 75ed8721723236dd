"""`horovodrun` whose gloo rendezvous server listens only where the workers are told to call.

Horovod 0.28.1's horovodrun has no option for the address of its rendezvous HTTP server:
`horovod.runner.util.network.find_port` binds ('', port), every interface, even when every
worker runs on this machine. `--network-interface(s)` only chooses what the workers are told
(HOROVOD_GLOO_RENDEZVOUS_ADDR, the IPv4 address of that interface, and HOROVOD_GLOO_IFACE,
which the workers' own gloo sockets bind to). For a single host horovodrun picks the
interface of 127.0.0.1. This script runs horovodrun's own command line with the rendezvous
server bound to that very address: loopback for a single host, the job's interface for
several.

It also answers horovodrun's "was Horovod built with Gloo?" sooner. Horovod asks it before
every launch by importing `horovod.tensorflow`, TensorFlow and all, in a forked child: 2-3 s
on a 2-core machine, in series before any worker starts, on each `--max-restarts` restart
too. The answer is the extension's own `horovod_gloo_built()`, which a child started first
thing here calls through ctypes, loading the extension and the TensorFlow libraries it
links to but not TensorFlow's Python (~0.3 s, while horovodrun imports itself). When that
child does not say yes (another layout, no TensorFlow extension, a failure), horovodrun's
own check decides, as before.

And it ends a rank's shell without horovodrun's 5 s stall. When one rank fails, horovodrun's
middleman process of every other rank SIGTERMs the children of that rank's shell (`sh -c
"VARS... COMMAND"`), waits for them, then SIGSTOPs the shell before it SIGTERMs it; a shell
stopped before it could exit (it had just reaped its command: a race, lost more often on a
busy machine) holds the SIGTERM pending until SIGKILL 5 s later, and the job's end, with
the next restart, waits for it. Here the shell is stopped only while children of it that
outlived their SIGTERM are killed, as horovodrun does it then, and whatever else is left in
the middleman's session is killed last (a command forked as the rank was being ended, which
held its output pipes, and horovodrun with them). The middlemen get this by importing this
script (multiprocessing's spawn imports the main script in each child).

`parallax run` starts it with horovodrun's interpreter (the script imports Horovod only, not
parallax): `python horovodrun_bound.py -np 2 -H localhost:2 --gloo COMMAND`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path


def _load_leftovers():
    """`parallax/runtime/leftovers.py` (standard library only), loaded from its file: the
    interpreter horovodrun runs with need not import parallax."""
    path = Path(__file__).resolve().parents[2] / "runtime" / "leftovers.py"
    spec = importlib.util.spec_from_file_location("parallax_leftovers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GLOO_BUILT = "--parallax-gloo-built"  # argv[1] of the child that answers for the extension
_RANK_VAR = re.compile(r"\bHOROVOD_RANK=(\d+)")  # in the command gloo_run gives a middleman
# what horovodrun raises once a rank failed, after its "Process N exit with status code C."
_RANK_FAILED = "Horovod detected that one or more processes exited with non-zero status"


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


def ask_extension() -> subprocess.Popen | None:
    """Start the child that asks Horovod's TensorFlow extension whether it was built with
    Gloo (`_print_gloo_built`), both found without importing them: it answers while
    horovodrun imports itself and looks at the network. None when either is missing."""
    horovod = importlib.util.find_spec("horovod")
    tensorflow = importlib.util.find_spec("tensorflow")
    if not (horovod and horovod.submodule_search_locations and tensorflow
            and tensorflow.submodule_search_locations):
        return None
    # where horovod.common.util.get_extension_full_path puts it
    extension = os.path.join(horovod.submodule_search_locations[0], "tensorflow",
                             "mpi_lib" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    try:
        return subprocess.Popen([sys.executable, __file__, GLOO_BUILT, extension,
                                 tensorflow.submodule_search_locations[0]],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def quick_gloo_built(asked: subprocess.Popen | None) -> None:
    """horovodrun's Gloo check (`horovod.common.util.gloo_built`, as `launch` imported it)
    takes the extension's yes from the child `asked`; anything else, and it checks as
    before."""
    from horovod.runner import launch

    gloo_built = launch.gloo_built

    def asked_first(verbose: bool = False):
        return True if extension_said_yes(asked) else gloo_built(verbose=verbose)

    launch.gloo_built = asked_first


def extension_said_yes(asked: subprocess.Popen | None) -> bool:
    """Whether the child said yes."""
    if asked is None:
        return False
    try:
        out, _ = asked.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _end(asked)
        return False
    return asked.returncode == 0 and out.strip() == b"True"


def _end(asked: subprocess.Popen | None) -> None:
    if asked is not None and asked.poll() is None:
        asked.kill()
        asked.communicate()


def end_shell_and_children(pid: int) -> None:
    """horovodrun's end of a rank's shell and its command
    (`safe_shell_exec.terminate_executor_shell_and_children`), but for its SIGSTOP of the
    shell, kept for when a child of it outlived its SIGTERM, and with what is left of the
    rank in the caller's session ended too (`_end_session_rest`)."""
    import psutil
    from horovod.runner.common.util.safe_shell_exec import GRACEFUL_TERMINATION_TIME_S as grace
    try:
        shell = psutil.Process(pid)
        children = shell.children()
    except psutil.NoSuchProcess:
        _end_session_rest(psutil.pids())
        return
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace)
    if alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            shell.send_signal(signal.SIGSTOP)  # it starts nothing new meanwhile
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                for grandchild in child.children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        grandchild.kill()
                child.kill()
    with contextlib.suppress(psutil.NoSuchProcess):
        shell.terminate()
    try:
        shell.wait(timeout=grace)
    except psutil.TimeoutExpired:
        with contextlib.suppress(psutil.NoSuchProcess):
            shell.kill()
    _end_session_rest(psutil.pids())


def _end_session_rest(pids: list[int]) -> None:
    """SIGKILL every process of `pids` in the session this process leads (a middleman's:
    os.setsid) but itself. A command the rank's shell forked just after the scan of its
    children (the rank ended as it started) is left there, its parent gone, holding the
    rank's output pipes, and horovodrun with them, until it ends (a rank at hvd.init():
    its timeout): 6 in 100 ends at 0-10 ms after the shell's start with horovodrun's own
    end, 1 in 200 without the SIGSTOP, none in 500 with this; so is what the command put
    in the background."""
    me = os.getpid()
    if os.getsid(0) != me:
        return  # not a session leader: what shares its session is not the rank's
    for pid in pids:
        with contextlib.suppress(OSError):
            if pid != me and os.getsid(pid) == me:
                os.kill(pid, signal.SIGKILL)


def _end_shells_unstopped() -> None:
    from horovod.runner.common.util import safe_shell_exec
    safe_shell_exec.terminate_executor_shell_and_children = end_shell_and_children
    safe_shell_exec._exec_middleman = _middleman_ending_leftovers(safe_shell_exec._exec_middleman)


def _middleman_ending_leftovers(middleman):
    """horovodrun's middleman (`safe_shell_exec._exec_middleman`), which ends what the rank
    left holding its output pipes once its shell exited (`leftovers`): horovodrun waits for
    the pipes' end of file before it reports the rank's exit."""
    def ending_leftovers(command, env, exit_event, stdout, stderr, rw):
        try:
            middleman(command, env, exit_event, stdout, stderr, rw)
        finally:
            rank = _RANK_VAR.search(command if isinstance(command, str) else "")
            who = f"worker rank {rank[1] if rank else '?'}"
            _load_leftovers().end_holders([stdout[1].fileno(), stderr[1].fileno()], who)
    return ending_leftovers


def _print_gloo_built(extension: str, libraries: str) -> None:
    """The child: print the extension's horovod_gloo_built(), loading it with ctypes; the
    shared libraries it needs that the loader cannot find (TensorFlow's, which its Python
    loads first) come from `libraries`, TensorFlow's package directory."""
    import ctypes
    for _ in range(8):
        try:
            library = ctypes.CDLL(extension, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as err:
            missing = re.match(r"([^/:\s]+): cannot open shared object file", str(err))
            if missing is None:
                raise
            ctypes.CDLL(os.path.join(libraries, missing[1]), mode=ctypes.RTLD_GLOBAL)
    else:
        raise OSError(f"{extension}: its libraries did not load")
    print(bool(library.horovod_gloo_built()), flush=True)


def main() -> None:
    if sys.argv[1:2] == [GLOO_BUILT]:
        _print_gloo_built(*sys.argv[2:4])
        return
    asked = ask_extension()
    try:
        _bind_rendezvous_to_server_ip()
        quick_gloo_built(asked)
        from horovod.runner.launch import run_commandline
        sys.argv[0] = "horovodrun"
        code = run_commandline()
    except RuntimeError as err:
        if not str(err).startswith(_RANK_FAILED):
            raise
        code = 1  # reported already, line by line (`parallax run` names the first failure)
    finally:
        _end(asked)  # horovodrun never asked (--help, a bad flag)
    sys.exit(code)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a middleman of horovodrun's, spawned by multiprocessing
    _end_shells_unstopped()
