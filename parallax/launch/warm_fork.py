"""The warm process: Python with TensorFlow, Keras, Horovod and parallax imported, forking a
worker for each `warm_stub.py` that asks (`python -m parallax.launch.warm_fork SOCKET`).

Importing TensorFlow costs each worker ~2.5 s of CPU and Keras and parallax ~1 s more; a
restart pays it again for every worker, all at once. Here it is paid once per launcher:
the fork is ready in milliseconds. `parallax.launch.warm` starts this process (and, over ssh,
`warm_remote` one on each other host) and rewrites the workers' command; the contract with
the stub is in `warm_stub`. SOCKET's directory is made private (0700) here, or refused
(exit 3, the reason on stderr) where it is not this user's own; the process starts in it,
and says on stdout that it listens (LISTENING, then JSON), before its imports.

A forked worker becomes what `python SCRIPT ARGS` (or `python -m MODULE ARGS`) would have
been, started by the stub: its environment, arguments, working directory, standard streams,
umask, niceness and CPU affinity are the stub's; `sys.path` starts with the script's
directory. It refuses (the stub then starts the command cold) where a fork cannot be the
same: another namespace, cgroup, user or rlimit, other PYTHON* variables, variables read as
a process starts (START_ENV: locale, LD_PRELOAD) or as TensorFlow and Keras are imported
(IMPORT_TIME_ENV), a module imported here that the worker's `sys.path` would find
elsewhere (its script's directory holding a `secrets.py`, say), a script Python cannot open
as a file, and one whose source may set such a variable or sets up logging before it
imports TensorFlow (what a cold worker's `import tensorflow` would see: `_source_refusal`).
What a fork shares with its siblings and cold workers would not: the interpreter's hash
seed (set iteration order).
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

import ast
import atexit
import builtins
import contextlib
import ctypes
import functools
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
import types

from parallax.launch.warm_stub import (LENGTH, exactly, host_socket, identity,
                                       private_refusal, send)

PRELOAD = ("numpy", "tensorflow", "keras", "horovod.tensorflow", "parallax.tf",
           "parallax.tf.strategy.parallax_strategy")  # (the client, gRPC, the planner too)
# what TensorFlow, Keras, XLA, gRPC and numpy's BLAS read from the environment as they are
# imported (or at their first log line, which their imports here wrote): a warm worker runs
# with the values this process had then, whatever its own environment or its script says
IMPORT_TIME_ENV = ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MIN_VLOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL",
                   "TF_CPP_VMODULE", "TF_ENABLE_ONEDNN_OPTS", "TF_USE_LEGACY_KERAS",
                   "TF_XLA_FLAGS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "KERAS_BACKEND",
                   "KERAS_HOME", "GRPC_VERBOSITY", "GRPC_TRACE", "GRPC_ENABLE_FORK_SUPPORT",
                   "GRPC_POLL_STRATEGY", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                   "OPENBLAS_NUM_THREADS",
                   "TMPDIR", "TEMP", "TMP",  # (TensorFlow's import caches tempfile.tempdir)
                   "HOME")  # (Keras reads ~/.keras/keras.json as it is imported)
# what the interpreter and the dynamic loader read as a process starts (the standard
# streams' encoding, the libraries loaded): compared, not looked for in a script, which
# cannot change them for itself, cold or warm
START_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "LD_PRELOAD", "LD_LIBRARY_PATH", "TZ")
IMPORTS_TENSORFLOW = ("tensorflow", "keras", "tf_keras", "horovod", "parallax")
LOGGING_SETUP = ("basicConfig", "dictConfig", "fileConfig", "addHandler")
STREAMS = ("stdout", "stderr")  # sys's, which TensorFlow's and absl's log handlers take
LISTENING = "parallax-warm-process listening "  # then JSON: what the launcher checks
STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm_stub.py")
_PR_SET_PDEATHSIG = 1
_REQUEST_TIMEOUT_S = 10.0
_held = []  # this process's own standard streams, kept so that closing them never closes 0-2
# (and, in a worker, this module's __main__, which the program's replaced)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m parallax.launch.warm_fork SOCKET ROOM (ROOM: a long string "
              "whose space a worker's command line takes, for ps)", file=sys.stderr)
        return 2
    _retitle(["parallax-warm-process", argv[1]])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its workers' is theirs (reset there)
    why = _settle(os.path.dirname(argv[1]))
    if why is not None:
        print(f"parallax warm process: {why}", file=sys.stderr, flush=True)
        return 3
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = host_socket(argv[1])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # (a socket left by a warm process of this directory that was killed)
    listener.bind(path)  # before the imports: stubs that come early wait, not go cold
    listener.listen(128)
    signal.signal(signal.SIGTERM, functools.partial(_leave, os.getpid(), path))
    print(LISTENING + json.dumps({"socket": path, "python": sys.executable, "stub": STUB,
                                  "gpus": _gpus()}), flush=True)
    _preload()
    conn, request, fds = _serve(listener, _Same.now())  # returns in a forked worker only
    return _work(conn, request, fds)


def _settle(directory: str) -> str | None:
    """Make `directory` (0700) unless there, check that it is this user's private one (the
    stubs send it their environment: `private_refusal`), and start in it as a cold worker
    starts in its script's directory: the working directory, and first on sys.path in place
    of the one `-m` put there (the directory the process was started in: over ssh, the
    home directory). Returns why it cannot be used, or None."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot make {directory} ({exc.strerror or exc})"
    why = private_refusal(directory)
    if why is not None:
        return why
    os.chdir(directory)
    if not sys.flags.safe_path:
        sys.path[0] = directory
    return None


def _leave(me: int, path: str, signum: int, frame) -> None:
    """On SIGTERM: remove the socket and its directory if that is empty (another host's is
    left behind otherwise), then end by the signal (the workers end with this process). A
    worker that gets it before it reset the handler just ends."""
    if os.getpid() == me:
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _gpus() -> bool:
    """Whether this machine has NVIDIA GPUs (`parallax.launch.warm.gpu_machine`)."""
    return any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev"))


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
        self.start_env = {k: os.environ[k] for k in (*START_ENV, *IMPORT_TIME_ENV)
                          if k in os.environ}
        self.import_env = {k: v for k, v in self.start_env.items() if k in IMPORT_TIME_ENV}

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
        changed = [k for k in (*START_ENV, *IMPORT_TIME_ENV)
                   if request["env"].get(k) != self.start_env.get(k)]
        if changed:
            return f"the worker's {changed[0]} is not the warm process's (read as it started)"
        target = _target(request["argv"])
        if target is None:
            return f"{request['argv'][:3]} is not `python SCRIPT` or `python -m MODULE`"
        path = self.worker_path(target, request["cwd"])
        why = _source_refusal(target, path, request["cwd"], self.import_env)
        if why is not None:
            return why
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


def _source_refusal(target: tuple[str, str, list], path: list[str], cwd: str,
                    import_env: dict) -> str | None:
    """Why the program's own source rules a fork out, or None. A script Python cannot read
    (missing, a directory or zip file with a __main__.py) starts cold, where Python itself
    says so or runs it. What a script does before its `import tensorflow`, a fork cannot
    replay (TensorFlow is imported already): a source that may change a variable of
    IMPORT_TIME_ENV from this process's value (`_sets_import_env`: `os.environ[
    "TF_CPP_MIN_LOG_LEVEL"] = "3"`, `KERAS_BACKEND`), or that sets up logging before it
    imports TensorFlow (`_logs_first`), starts cold. Only the script (or the module of `-m`,
    where found on `path`) is read, not what it imports: a helper module that sets these,
    or a script that builds their names, is not seen."""
    kind, name, _ = target
    where = os.path.join(cwd, name) if kind == "script" else _module_file(name, path)
    if where is None:
        return None  # (a module found by another finder: nothing to read here)
    try:
        if not os.path.isfile(where):
            raise IsADirectoryError(where)
        with open(where, "rb") as file:
            source = file.read()
    except OSError:
        return f"cannot read {name} as a file"
    if not any(v.encode() in source for v in (*IMPORT_TIME_ENV, *LOGGING_SETUP, *STREAMS)):
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None  # (it fails alike, warm or cold)
    variable = _sets_import_env(tree, import_env)
    if variable is not None:
        return f"{name} may set {variable}, which TensorFlow read here as it was imported"
    if _logs_first(tree):
        return f"{name} sets up logging or replaces sys.stdout/stderr before importing " \
               "TensorFlow (whose import then adds no handler, or one on those)"
    return None


def _sets_import_env(tree: ast.AST, import_env: dict) -> str | None:
    """The first variable of IMPORT_TIME_ENV that the program may set to another value than
    `import_env`'s (this process's and, checked before, the worker's), or None. Harmless:
    reading NAME (`os.environ[NAME]`, `os.environ.get(NAME)`, `os.getenv(NAME)`),
    `os.environ[NAME] = "VALUE"` with this process's VALUE, and `os.environ.setdefault(NAME,
    ...)` where NAME is set; any other mention of NAME (a dict's key, `update(NAME=...)`,
    `pop`, a value computed) counts as a change."""
    harmless = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_environ(node.value):
            harmless.add(id(node.slice))
        elif isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                 and _is_environ(node.func.value)) or _called(node.func) == "getenv"):
            harmless.add(id(node.args[0]))
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Subscript) \
                and _is_environ(node.targets[0].value) \
                and isinstance(node.value, ast.Constant) \
                and import_env.get(_text(node.targets[0].slice)) == node.value.value:
            harmless.add(id(node.targets[0].slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "setdefault" and _is_environ(node.func.value) \
                and node.args and _text(node.args[0]) in import_env:
            harmless.add(id(node.args[0]))
    for node in ast.walk(tree):
        named = _text(node) if isinstance(node, ast.Constant) else getattr(node, "arg", None)
        if named in IMPORT_TIME_ENV and (isinstance(node, ast.keyword)
                                         or id(node) not in harmless):
            return named
    return None


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _text(node: ast.AST) -> str | None:
    value = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
    return value if isinstance(value, str) else None


def _module_file(name: str, path: list[str]) -> str | None:
    """The file `python -m name` runs, looked up on `path` without importing its packages
    here (their __init__ is the worker's code)."""
    parts = name.split(".")
    for entry in path:
        base = os.path.join(entry or ".", *parts)
        for candidate in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def _logs_first(tree: ast.Module) -> bool:
    """Whether the source sets up logging (LOGGING_SETUP) or replaces sys.stdout or
    sys.stderr before (in its text, as a guess at the order it runs in) it first imports
    TensorFlow (IMPORTS_TENSORFLOW): a cold worker's `import tensorflow` then sees the root
    logger's handler and gives TensorFlow's logger none, or gives it one on the new stream;
    here it has one on the worker's own stderr already (each TensorFlow message twice, once
    through the root's; or not in the script's log file)."""
    first = min(((node.lineno, node.col_offset, _imports_tensorflow(node))
                 for node in ast.walk(tree)
                 if _imports_tensorflow(node) or _sets_up_output(node)), default=None)
    return first is not None and not first[2]


def _sets_up_output(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return _called(node.func) in LOGGING_SETUP
    targets = node.targets if isinstance(node, ast.Assign) else []
    targets = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List))
                                            else [t])]  # (`real, sys.stderr = ...`)
    return any(isinstance(t, ast.Attribute) and t.attr in STREAMS
               and getattr(t.value, "id", None) == "sys" for t in targets)


def _imports_tensorflow(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.partition(".")[0] in IMPORTS_TENSORFLOW for a in node.names)
    return isinstance(node, ast.ImportFrom) and not node.level and \
        (node.module or "").partition(".")[0] in IMPORTS_TENSORFLOW


def _called(func: ast.AST) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


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
    for signum in request.get("ignored", ()):  # the stub's, inherited: Python keeps them so
        signal.signal(signum, signal.SIG_IGN)
    conn.close()  # (the warm process watches it: the stub's death kills this worker there)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    _moved(os.getcwd(), request["cwd"])
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


def _moved(here: str, cwd: str) -> None:
    """Change to the worker's working directory, and make what the preloads noted as the
    directory they were imported in (`here`, this process's private one) `cwd`, as a cold
    worker's imports would have: module globals equal to it (multiprocessing's
    ORIGINAL_DIR, which its spawned children start from; rich's _IMPORT_CWD, Keras's
    tracebacks')."""
    os.chdir(cwd)
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict):
            for key in [k for k, v in names.items() if isinstance(v, str) and v == here]:
                names[key] = cwd


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
        getattr(buffer, "raw", buffer).name = ("<stdin>", "<stdout>", "<stderr>")[fd]
        text = io.TextIOWrapper(
            buffer, encoding=getattr(old, "encoding", None) or "utf-8",
            errors="backslashreplace" if fd == 2 else getattr(old, "errors", "strict"),
            newline="\n", write_through=unbuffered,  # (stdin's too, as Python's)
            line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)))
        text.mode = mode  # (Python's have it, and the names above; open's have neither)
        made.append(text)
    _held.extend(s for s in (sys.__stdin__, sys.__stdout__, sys.__stderr__) if s is not None)
    _repoint_handlers({id(sys.__stdout__): made[1], id(sys.__stderr__): made[2]})
    sys.stdin, sys.stdout, sys.stderr = made
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def _repoint_handlers(new: dict) -> None:
    """The logging handlers that the preloads made on this process's sys.stdout or stderr
    (TensorFlow's logger's, absl's), on the worker's instead: a cold worker's imports
    make them on its own streams (sys.stderr is its sys.stderr; a script that replaces
    sys.stderr and then logs through them reaches the same object)."""
    import logging
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = [h for lg in loggers for h in getattr(lg, "handlers", ())]
    absl = sys.modules.get("absl.logging")
    if absl is not None and hasattr(absl, "get_absl_handler"):
        handlers.append(absl.get_absl_handler().python_handler)
    for handler in handlers:
        stream = vars(handler).get("stream")  # (not lastResort's: a property, sys.stderr)
        if isinstance(handler, logging.StreamHandler) and id(stream) in new:
            handler.stream = new[id(stream)]


def _run(kind: str, name: str, args: list[str]) -> int:
    """The script or module as __main__, in a module that stays sys.modules["__main__"]
    for the worker's life, as Python's own does (runpy.run_path put the warm process's back
    once the script's body returned: its threads and atexit handlers could not pickle its
    classes); an uncaught exception ends it as at Python's top level (`_uncaught`)."""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # the module, as in Python's __main__ (exec puts its dict)
    _held.append(sys.modules["__main__"])  # this module's, whose globals run on here
    sys.modules["__main__"] = main
    if "__mp_main__" in sys.modules:  # multiprocessing's import made it __main__'s alias
        sys.modules["__mp_main__"] = main
    try:
        if kind == "module":
            sys.argv = ["-m", *args]  # as `python -m` has it while it finds the module
            runpy._run_module_as_main(name)  # its errors finding it: one line, as Python's
        else:
            sys.argv = [name, *args]
            _run_script(main, os.path.join(os.getcwd(), name))  # as Python's: not normalized
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the top level of the worker's program
        _uncaught(exc)
        return 1
    return 0


def _run_script(main: types.ModuleType, path: str) -> None:
    """Run the script at `path` in `main` as `python SCRIPT` does (its globals included:
    __file__, __cached__ None, a SourceFileLoader as __loader__)."""
    main.__file__, main.__cached__ = path, None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    with io.open_code(path) as file:
        code = compile(file.read(), path, "exec")
    exec(code, vars(main))  # noqa: S102 - the worker's own program


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
