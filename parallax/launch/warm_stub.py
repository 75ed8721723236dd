"""A worker's command, started warm: `python -S warm_stub.py SOCKET -- PYTHON SCRIPT ARGS...`.

What horovodrun (or any backend) starts in place of the worker when `parallax run` keeps a
warm process (`parallax.launch.warm`). It asks the warm process at SOCKET to fork the worker
with this process's arguments, environment, working directory and standard streams (passed
as file descriptors), then stands in for it: signals sent to it go to the worker, and it
exits as the worker did (by the same signal, for a death by a signal). Its own death ends
the worker (the warm process watches the connection). Where the warm process cannot start the
worker (gone, refusing: another network namespace, cgroup, user or rlimit), it runs the
command itself (exec), as if it had never been there: a cold start. So it does where SOCKET's
directory is not this user's own, private (0700) one: the request carries the environment,
tokens included, and another user's directory may hold another user's listener.

SOCKET names one socket per network namespace (`host_socket`): the launcher gives every
host's workers the same command line, and the warm process serves only the workers of its
own namespace (hosts emulated by namespaces on one machine share the directory).

Standard library only, and started with -S (no site-packages): it costs ~20 ms, not the
seconds TensorFlow's import does. The wire contract, shared with `parallax.launch.warm_fork`:
messages are a 4-byte big-endian length and that many bytes of JSON; the request
{"argv", "env", "cwd", "identity", "umask", "nice", "cpus", "ignored"} carries fds 0, 1 and 2
(SCM_RIGHTS; "ignored": the FORWARDED signals this process inherited ignored);
the replies are {"pid": N} or {"cold": why}, then {"status": os.wait status} when it ends.
"""
import json
import os
import resource
import signal
import socket
import stat
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
_NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts")
LENGTH = struct.Struct(">I")  # a message's length, before its JSON
_worker = None  # the forked worker's pid, once the warm process said it


def identity():
    """What a forked worker cannot change and must share with the command it replaces:
    namespaces, cgroups, user and groups, resource limits."""
    spaces = {}
    for name in _NAMESPACES:
        try:
            spaces[name] = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            spaces[name] = None
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as file:
            cgroups = file.read()
    except OSError:
        cgroups = None
    limits = {name: resource.getrlimit(getattr(resource, name))
              for name in sorted(dir(resource)) if name.startswith("RLIMIT_")}
    return {"ns": spaces, "cgroup": cgroups, "uid": os.getuid(), "gid": os.getgid(),
            "groups": sorted(os.getgroups()), "rlimits": limits}


def send(sock, message, fds=()):
    data = json.dumps(message).encode()
    data = LENGTH.pack(len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):  # (sendall of nothing still sends: EPIPE once the peer answered)
        sock.sendall(data[sent:])


def receive(sock):
    """The next message, or None at the end of the connection."""
    head = exactly(sock, LENGTH.size)
    if head is None:
        return None
    body = exactly(sock, LENGTH.unpack(head)[0])
    return None if body is None else json.loads(body)


def exactly(sock, count):
    """The next `count` bytes from `sock`; None when it ends first."""
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _request(program, ignored=()):
    umask = os.umask(0o022)
    os.umask(umask)
    return {"argv": program, "env": dict(os.environ), "cwd": os.getcwd(),
            "identity": identity(), "umask": umask, "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "cpus": sorted(os.sched_getaffinity(0)), "ignored": [int(s) for s in ignored]}


def host_socket(path):
    """The socket of this network namespace's warm process: PATH-INODE (the namespace's
    inode number), or PATH where /proc does not say."""
    try:
        space = os.readlink("/proc/self/ns/net")
    except OSError:
        return path
    return f"{path}-{''.join(c for c in space if c.isdigit())}"


def private_refusal(directory):
    """Why `directory` is not this user's private one (a directory, not a link, owned by
    this user, mode 0700, in a parent that no other user can change), or None."""
    try:
        info = os.lstat(directory)
        parent = os.stat(os.path.dirname(os.path.abspath(directory)))
    except OSError as exc:
        return f"cannot use {directory} ({exc.strerror or exc})"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory (a link or a file): remove it"
    if info.st_uid != os.geteuid():
        return f"{directory} is owned by uid {info.st_uid}, not this user (uid " \
               f"{os.geteuid()}): remove it, or set TMPDIR to a directory of your own"
    if info.st_mode & 0o077:
        return f"{directory} has mode {stat.S_IMODE(info.st_mode):o}, not 700: remove it"
    if parent.st_uid not in (0, os.geteuid()) or (parent.st_mode & 0o022
                                                  and not parent.st_mode & stat.S_ISVTX):
        return f"{os.path.dirname(os.path.abspath(directory))}, the parent of {directory}, " \
               f"can be changed by other users (uid {parent.st_uid}, mode " \
               f"{stat.S_IMODE(parent.st_mode):o}): set TMPDIR to a directory of your own"
    return None


def _ask(path, program, ignored=()):
    """(the connection, the worker's pid) once the warm process forked it; (None, why) when
    it will not."""
    why = private_refusal(os.path.dirname(path))
    if why is not None:
        return None, why
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(host_socket(path))
        send(sock, _request(program, ignored), (0, 1, 2))
        reply = receive(sock)
    except OSError as exc:
        sock.close()
        return None, f"the warm process at {path} is not there ({exc.strerror or exc})"
    if reply is None or "pid" not in reply:
        sock.close()
        return None, (reply or {}).get("cold", "the warm process closed the connection")
    return sock, reply["pid"]


def _forward(signum, frame):
    if _worker is None:  # not started yet: end as the command would have
        _die_by(signum)
    try:
        os.kill(_worker, signum)
    except ProcessLookupError:
        pass


def _die_by(signum):
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os._exit(128 + signum)


def _cold(program, why):
    if why and os.environ.get("PARALLAX_WARM_DEBUG"):
        print(f"parallax warm start: {why}; starting {program[0]} cold", file=sys.stderr,
              flush=True)
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        print(f"parallax warm start: cannot run {program[0]}: {exc}", file=sys.stderr,
              flush=True)
        os._exit(127)


def main(argv):
    global _worker
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -S warm_stub.py SOCKET -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    path, program = argv[1], argv[3:]
    # one ignored here (nohup's SIGHUP; SIGINT and SIGQUIT of a shell's background job)
    # stays ignored, by the worker too, as an exec'd command keeps it: not forwarded
    ignored = [s for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN]
    for signum in FORWARDED:
        if signum not in ignored:
            signal.signal(signum, _forward)
    sock, pid = _ask(path, program, ignored)
    if sock is None:
        for signum in FORWARDED:
            if signum not in ignored:
                signal.signal(signum, signal.SIG_DFL)
        _cold(program, pid)
    _worker = pid
    try:
        ended = receive(sock)
    except OSError:
        ended = None
    if ended is None:  # the warm process died; its workers die with it (PR_SET_PDEATHSIG)
        print(f"parallax warm start: the warm process ended before worker {pid}",
              file=sys.stderr, flush=True)
        return 1
    code = os.waitstatus_to_exitcode(ended["status"])
    if code < 0:
        _die_by(-code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
