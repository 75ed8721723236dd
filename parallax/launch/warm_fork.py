"""The warm process: Python with TensorFlow, Keras, Horovod and parallax imported, forking a
worker for each `warm_stub.py` that asks (`python -m parallax.launch.warm_fork SOCKET`).

Importing TensorFlow costs each worker ~2.5 s of CPU and Keras and parallax ~1 s more; a
restart pays it again for every worker, all at once. Here it is paid once per launcher:
the fork is ready in milliseconds. `parallax.launch.warm` starts this process and rewrites
the workers' command; the contract with the stub is in `warm_stub`.

A forked worker becomes what `python SCRIPT ARGS` (or `python -m MODULE ARGS`) would have
been, started by the stub: its environment, arguments, working directory, standard streams,
umask, niceness and CPU affinity are the stub's; `sys.path` starts with the script's
directory. It refuses (the stub then starts the command cold) where a fork cannot be the
same: another namespace, cgroup, user or rlimit, other PYTHON* variables, or a module
imported here that the worker's `sys.path` would find elsewhere (its script's directory
holding a `secrets.py`, say). What a fork shares with its
siblings and cold workers would not: the interpreter's hash seed (set iteration order).
Numpy's global random state is drawn again in each worker, as Python's `random` is.

Signals and ends: each worker leads a session of its own (horovodrun's cold ranks run in
sessions of their middlemen), so that what it signals as its process group is its own. It
gets SIGKILL when this process ends (PR_SET_PDEATHSIG) and, from this process, which
watches the stubs' connections, when its stub's connection closes (the stub was killed): a
worker holds no descriptor or thread of ours. This process reaps it and sends the stub its
wait status. Nothing here runs a worker's code before the fork: a fork only
inherits imports (numpy's OpenBLAS threads restart themselves after a fork).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import importlib.machinery
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading

from parallax.launch.warm_stub import LENGTH, exactly, identity, send

PRELOAD = ("numpy", "tensorflow", "keras", "horovod.tensorflow", "parallax.tf",
           "parallax.tf.strategy.parallax_strategy")  # (the client, gRPC, the planner too)
_PR_SET_PDEATHSIG = 1
_REQUEST_TIMEOUT_S = 10.0
_held = []  # this process's own standard streams, kept so that closing them never closes 0-2


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m parallax.launch.warm_fork SOCKET ROOM (ROOM: a long string "
              "whose space a worker's command line takes, for ps)", file=sys.stderr)
        return 2
    _retitle(["parallax-warm-process", argv[1]])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its workers' is theirs (reset there)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(argv[1])  # before the imports: stubs that come early wait, not go cold
    listener.listen(128)
    _preload()
    conn, request, fds = _serve(listener, _Same.now())  # returns in a forked worker only
    return _work(conn, request, fds)


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a worker that needs it meets the error itself
            pass


class _Same:
    """What a worker must share with this process to be forked from it."""

    def __init__(self, ident: dict, python_env: dict, path: list[str]) -> None:
        self.identity, self.python_env, self.path = ident, python_env, path

    @classmethod
    def now(cls) -> "_Same":
        base = sys.path if sys.flags.safe_path else sys.path[1:]
        return cls(identity(), _python_env(os.environ), base)

    def refusal(self, request: dict) -> str | None:
        """Why a worker must start cold, or None."""
        for key, mine in self.identity.items():
            if request["identity"].get(key) != _plain(mine):
                return f"the worker's {key} is not the warm process's"
        if _python_env(request["env"]) != self.python_env:
            return "the worker's PYTHON* variables are not the warm process's"
        target = _target(request["argv"])
        if target is None:
            return f"{request['argv'][:3]} is not `python SCRIPT` or `python -m MODULE`"
        path = self.worker_path(target, request["cwd"])
        for name in {n.split(".")[0] for n in PRELOAD} & set(sys.modules):
            if not _found_at(name, path):
                return f"the worker's sys.path finds another {name}"
        shadow = _shadowed(path[0]) if len(path) > len(self.path) else None
        if shadow is not None:
            return f"{path[0]} has a {shadow} of its own (the warm process imported another)"
        return None

    def worker_path(self, target: tuple[str, str, list], cwd: str) -> list[str]:
        if sys.flags.safe_path:
            return list(self.path)
        kind, name, _ = target
        first = cwd if kind == "module" else os.path.dirname(
            os.path.realpath(os.path.join(cwd, name)))
        return [first, *self.path]


def _plain(value):
    """`value` as it comes back from JSON (tuples as lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _python_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


def _target(argv: list[str]) -> tuple[str, str, list] | None:
    """("script", path, args) or ("module", name, args) for `python ...` argv."""
    rest = argv[1:]
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] and not rest[1].startswith("-"):
        return "module", rest[1], rest[2:]
    if rest and rest[0] and not rest[0].startswith("-"):
        return "script", rest[0], rest[1:]
    return None


def _shadowed(first: str) -> str | None:
    """A module imported here (by the preloads, stdlib ones too: `secrets`, `code`, `six`)
    of which `first`, the entry a worker's sys.path starts with and this process's lacks,
    holds another: a cold worker would import that one, a fork has this one already."""
    for name in sorted({name.partition(".")[0] for name in list(sys.modules)}):
        module = sys.modules.get(name)
        if module is None or name in ("__main__", "__mp_main__"):
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, [first])
        if spec is None:
            continue
        where = getattr(module, "__file__", None)  # None: builtin, or a namespace package
        if where is None or os.path.realpath(spec.origin or "") != os.path.realpath(where):
            return name
    return None


def _found_at(name: str, path: list[str]) -> bool:
    """Whether a fresh import of top-level `name` on `path` finds the module loaded here."""
    spec = _find_spec(name, path)
    loaded = sys.modules[name]
    where = getattr(loaded, "__file__", None)
    if spec is None or where is None:
        return spec is None and where is None
    return os.path.realpath(spec.origin or "") == os.path.realpath(where)


def _find_spec(name: str, path: list[str]):
    """What `import name` (top-level) finds in a process whose sys.path is `path`: the
    import system's finders in order, the path finder searching `path` (the others, such as
    the finder of an editable install, `pip install -e`, answer whatever the path)."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, path)
        else:
            find = getattr(finder, "find_spec", None)
            spec = find(name, None) if find is not None else None
        if spec is not None:
            return spec
    return None


def _serve(listener: socket.socket, same: _Same):
    """Fork a worker for each stub that asks, reap them and tell their stubs how they ended;
    a worker whose stub is gone (killed) is killed. Returns (connection, request, fds) in a
    forked worker."""
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    workers = _Workers(selector)
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_r:
                _drain(wake_r)
                workers.reap()
            elif key.fileobj is not listener:
                workers.heard(key.fileobj, key.data)
            else:
                started = _start(listener, same, workers)
                if started is not None:  # the forked worker: leave the warm process behind
                    signal.set_wakeup_fd(-1)
                    selector.close()
                    listener.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    return started


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


class _Workers:
    """The forked workers (pid -> their stub's connection), each connection watched: the
    stub sends nothing after its request, so the connection's end means the stub was
    killed, and its worker is killed too (here, not in the worker: a worker holds no
    descriptor and no thread of ours, and closing every descriptor does not end it)."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector, self.conns = selector, {}

    def add(self, pid: int, conn: socket.socket) -> None:
        self.conns[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def heard(self, conn: socket.socket, pid: int) -> None:
        try:
            if conn.recv(4096):
                return  # (nothing is expected: read and ignored)
        except OSError:
            pass
        self.selector.unregister(conn)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # its stub is gone; reaped as any other

    def reap(self) -> None:
        while self.conns:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.conns.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(conn)
                _tell(conn, {"status": status})

    def close_all(self) -> None:
        """In a forked worker: its siblings' connections are not its own."""
        for conn in self.conns.values():
            conn.close()


def _tell(conn: socket.socket, message: dict) -> None:
    try:
        send(conn, message)
    except OSError:
        pass  # the stub is gone (its worker then was killed)
    conn.close()


def _start(listener: socket.socket, same: _Same, workers: _Workers):
    """Take one stub's request and fork its worker; (conn, request, fds) in the worker."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        conn.settimeout(_REQUEST_TIMEOUT_S)
        request, fds = _request(conn)
        conn.settimeout(None)
        why = same.refusal(request) if len(fds) == 3 else "the stub sent no standard streams"
        if why is None:
            kind, name, _ = _target(request["argv"])
            request["path"] = same.worker_path((kind, name, None), request["cwd"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        request, why = None, f"unreadable request ({exc})"
    if why is not None:
        for fd in fds:
            os.close(fd)
        _tell(conn, {"cold": why})
        return None
    pid = os.fork()
    if pid == 0:
        workers.close_all()
        return conn, request, fds
    for fd in fds:
        os.close(fd)
    workers.add(pid, conn)
    try:
        send(conn, {"pid": pid})
    except OSError:
        pass  # the stub is gone: the connection's end kills its worker
    return None


def _request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One stub's request (`warm_stub.send`'s framing) and the descriptors it carried;
    ValueError for an unreadable one, whose descriptors are closed again."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    try:
        data += exactly(conn, max(LENGTH.size - len(data), 0)) or b""
        if len(data) < LENGTH.size:
            raise ValueError("cut short")
        length, body = LENGTH.unpack(data[:LENGTH.size])[0], data[LENGTH.size:]
        body += exactly(conn, max(length - len(body), 0)) or b""
        if len(body) < length:
            raise ValueError("cut short")
        return json.loads(body[:length]), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


# ---------------------------------------------------------------------------- in the worker

def _work(conn: socket.socket, request: dict, fds: list[int]) -> int:
    """Become the stub's command and run it; returns its exit code (or raises SystemExit)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)  # the warm process died before the line above
    os.setsid()  # its own session and process group, as a cold rank's: its killpg(0) is its own
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                   signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conn.close()  # (the warm process watches it: the stub's death kills this worker there)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _adopt(request)
    _streams()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh process draws its own
    kind, name, args = _target(request["argv"])
    _retitle(request["argv"])
    sys.orig_argv = list(request["argv"])
    sys.path[:] = request["path"]
    return _run(kind, name, args)


def _retitle(argv: list[str]) -> None:
    """Show `argv` as this process's command line (/proc/PID/cmdline: ps, pgrep -f, what
    finds a worker by its script), written over the arguments this process was started
    with (the launcher leaves room), cut to fit."""
    try:
        with open("/proc/self/stat", "rb") as file:
            fields = file.read().rpartition(b")")[2].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5): 48, 49)
    except (OSError, IndexError, ValueError):
        return
    title = b"\0".join(os.fsencode(arg) for arg in argv)[:max(end - start - 1, 0)]
    ctypes.memmove(start, title + b"\0" * (end - start - len(title)), end - start)


def _adopt(request: dict) -> None:
    os.umask(request["umask"])
    for change in (lambda: os.setpriority(os.PRIO_PROCESS, 0, request["nice"]),
                   lambda: os.sched_setaffinity(0, request["cpus"])):
        try:
            change()
        except OSError:
            pass  # (a lower niceness needs privileges the stub had not either)


def _streams() -> None:
    """New sys.stdin/stdout/stderr on fds 0-2, buffered as Python's start-up makes them."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    made = []
    for fd, mode, old in ((0, "r", sys.__stdin__), (1, "w", sys.__stdout__),
                          (2, "w", sys.__stderr__)):
        raw = unbuffered and fd != 0
        buffer = open(fd, mode + "b", buffering=0 if raw else -1, closefd=False)
        made.append(io.TextIOWrapper(
            buffer, encoding=getattr(old, "encoding", None) or "utf-8",
            errors="backslashreplace" if fd == 2 else getattr(old, "errors", "strict"),
            newline="\n", write_through=raw,
            line_buffering=not raw and (fd == 2 or os.isatty(fd))))
    _held.extend(s for s in (sys.__stdin__, sys.__stdout__, sys.__stderr__) if s is not None)
    sys.stdin, sys.stdout, sys.stderr = made
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def _run(kind: str, name: str, args: list[str]) -> int:
    """The script or module as __main__; an uncaught exception ends it as at Python's top
    level (`_uncaught`)."""
    sys.argv = [name, *args]
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(os.path.abspath(name), run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the top level of the worker's program
        _uncaught(exc)
        return 1
    return 0


def _uncaught(exc: BaseException) -> None:
    """Report `exc` through sys.excepthook (the program may have set its own), without this
    module's and runpy's frames (runpy is frozen: its frames name "<frozen runpy>", not its
    __file__). A KeyboardInterrupt then ends the worker by SIGINT, as Python's top level
    does, but only after the exit's work: non-daemon threads joined, atexit handlers run,
    output flushed (the kill skips the interpreter's own)."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or tb.tb_frame.f_globals is vars(runpy)):
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    if isinstance(exc, KeyboardInterrupt):
        getattr(threading, "_shutdown", lambda: None)()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
