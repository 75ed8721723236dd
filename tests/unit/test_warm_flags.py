"""Warm starts without processes: the flag, when the launcher keeps a warm process, which
commands its stub replaces, and the stub's wire format (tests/parallel/test_warm_starts.py
runs workers through it)."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from parallax.errors import ConfigError
from parallax.launch import warm, warm_fork, warm_stub
from parallax.launch.hosts import load_hosts, parse_host_string
from parallax.launch.run import parse_args, validate, worker_path

LOCAL = parse_host_string("localhost:2")
PY = sys.executable


def test_the_flag_defaults_to_auto_and_takes_its_three_settings():
    assert parse_args(["--", "python", "-c", "pass"]).warm_starts == "auto"
    for setting in warm.WARM_STARTS:
        assert parse_args(["--warm-starts", setting, "--", "x"]).warm_starts == setting
    with pytest.raises(SystemExit):
        parse_args(["--warm-starts", "yes", "--", "x"])


def test_a_bad_setting_in_a_config_is_refused_by_name():
    import dataclasses
    config = dataclasses.replace(parse_args(["--", "true"]), warm_starts="always")
    with pytest.raises(ConfigError, match="--warm-starts 'always' must be one of auto, on, off"):
        validate(config)


@pytest.mark.parametrize("setting, restarts, gpus, want", [
    ("auto", True, False, True), ("auto", False, False, False), ("on", False, False, True),
    ("off", True, False, False), ("auto", True, True, False), ("on", True, True, True)])
def test_auto_keeps_a_warm_process_for_jobs_that_restart_off_gpu_machines(setting, restarts,
                                                                          gpus, want):
    assert warm.wanted(setting, restarts, gpus) is want


@pytest.mark.parametrize("program", [[PY, "train.py", "--epochs", "2"], [PY, "-m", "pkg.mod"],
                                     ["python", "train.py"]])
def test_python_scripts_and_modules_of_this_interpreter_start_warm(program):
    assert warm.why_cold(program, LOCAL, 2, worker_path()) is None


@pytest.mark.parametrize("program, why", [
    ([PY, "-c", "pass"], "not `python SCRIPT` or `python -m MODULE`"),
    ([PY, "-u", "train.py"], "not `python SCRIPT`"),  # flags a fork could not take
    ([PY, "-m"], "not `python SCRIPT`"),
    (["sh", "-c", "true"], "sh is not"),
    (["no-such-command-here", "x.py"], "no-such-command-here is not"),
])
def test_other_commands_start_cold_and_say_why(program, why):
    assert why in warm.why_cold(program, LOCAL, 2, worker_path())


def test_a_python_outside_this_environment_starts_cold(tmp_path):
    """Another interpreter file (a copy here; a base Python a venv links to, in life) has
    its own site-packages: its workers must not be forked from this one."""
    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").symlink_to(Path(PY).resolve())
    assert "is not" in warm.why_cold(["python", "t.py"], LOCAL, 1, str(other))


def test_this_python_through_a_symlinked_directory_starts_cold(tmp_path):
    """The same file, by another path: a cold worker's sys.executable, sys.prefix and its
    modules' __file__ are spelled by that path, the warm process's by its own."""
    (tmp_path / "env").symlink_to(Path(PY).parent.parent)
    linked = tmp_path / "env" / Path(PY).parent.name / Path(PY).name
    assert os.path.realpath(linked) == os.path.realpath(PY)
    assert "is not" in warm.why_cold([str(linked), "t.py"], LOCAL, 1, worker_path())


def test_workers_on_other_hosts_may_start_warm_but_gpu_slots_start_cold(tmp_path):
    # (another host's workers are forked from a warm process there: `warm_remote`)
    assert warm.why_cold([PY, "t.py"], parse_host_string("localhost:1,otherhost:1"), 2,
                         worker_path()) is None
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n  - {host: localhost, slots: 2, gpus: [0, 1]}\n")
    assert warm.why_cold([PY, "t.py"], load_hosts(hosts), 2, worker_path()) == \
        "GPU slots named"


def test_the_stub_and_the_warm_process_frame_messages_and_pass_descriptors_alike():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        warm_stub.send(ours, {"argv": ["python", "x.py"], "env": {"A": "1" * 70000}}, (0, 1, 2))
        request, fds = warm_fork._request(theirs)
        for fd in fds:
            os.close(fd)
        assert request["env"]["A"] == "1" * 70000 and len(fds) == 3  # longer than one recv
        warm_stub.send(theirs, {"pid": 7})
        assert warm_stub.receive(ours) == {"pid": 7}
        theirs.close()
        assert warm_stub.receive(ours) is None  # the end of the connection


@pytest.mark.parametrize("sent", [b"\x00\x00", b"\x00\x00\x00\x09{}", b"\x00\x00\x00\x02[x"])
def test_an_unreadable_request_is_refused_and_its_descriptors_closed(sent):
    """Cut short (in its length or its body) or not JSON: ValueError, and the descriptors
    it carried are closed again (the warm process lives as long as the launcher: a stub or
    a stray client that sent half a request must not leak three descriptors each)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        before = len(os.listdir("/proc/self/fd"))
        socket.send_fds(ours, [sent], [0, 1, 2])
        ours.shutdown(socket.SHUT_WR)
        with pytest.raises(ValueError):
            warm_fork._request(theirs)
        assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("argv, target", [
    (["python", "t.py", "-x"], ("script", "t.py", ["-x"])),
    (["python", "-m", "a.b", "c"], ("module", "a.b", ["c"])),
    (["python", "-c", "1"], None), (["python"], None), (["python", ""], None)])
def test_the_warm_process_takes_the_commands_the_launcher_sends(argv, target):
    assert warm_fork._target(argv) == target


def test_an_editable_installs_finder_counts_in_what_a_worker_would_import(tmp_path,
                                                                          monkeypatch):
    """`pip install -e` maps a package to its checkout through a finder on sys.meta_path,
    whatever sys.path says: a worker finds it there too (the path finder alone found
    nothing, so every worker of such an install, CI's, started cold)."""
    import importlib.util
    module = tmp_path / "checkout" / "editable_pkg_x.py"
    module.parent.mkdir()
    module.write_text("X = 1\n")

    class Editable:
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_file_location(name, module) \
                if name == "editable_pkg_x" else None

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Editable()])
    assert warm_fork._find_spec("editable_pkg_x", [str(tmp_path)]).origin == str(module)
    assert warm_fork._find_spec("no_such_module_here", [str(tmp_path)]) is None


def test_a_message_sent_whole_is_not_followed_by_an_empty_send():
    """send_fds sends a request whole (its few KB); sendall of the empty rest still calls
    send(2), which fails with EPIPE once the warm process has read the request, refused it
    and closed: the stub then took the warm process for gone ("not there (Broken pipe)")."""
    class Whole:
        def sendmsg(self, buffers, *args):
            return sum(len(b) for b in buffers)

        def send(self, data):
            return len(data)

        def sendall(self, data):
            raise BrokenPipeError(32, "Broken pipe")

    warm_stub.send(Whole(), {"argv": ["python", "x.py"]}, (0, 1, 2))
    warm_stub.send(Whole(), {"pid": 7})


ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize("source, changed", [
    ('import os\nos.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"\nimport tensorflow',
     "TF_CPP_MIN_LOG_LEVEL"),
    ('import os\nos.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"\n', None),  # its value already
    ('import os\nos.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")\n', None),  # set: a no-op
    ('import os\nos.environ.setdefault("KERAS_BACKEND", "jax")\n', "KERAS_BACKEND"),
    ('import os\nos.environ.update(KERAS_BACKEND="jax")\n', "KERAS_BACKEND"),
    ('from os import environ\nenviron.update({"TF_USE_LEGACY_KERAS": "1"})\n',
     "TF_USE_LEGACY_KERAS"),
    ('import os\nos.environ.pop("CUDA_VISIBLE_DEVICES")\n', "CUDA_VISIBLE_DEVICES"),
    ('import os\nos.environ["GRPC_VERBOSITY"] = "ERROR"\n', "GRPC_VERBOSITY"),  # gRPC's too
    ('print("TF_CPP_MIN_LOG_LEVEL=3 quiets TensorFlow")\n', None),  # text, not the name
    ('import os\nprint(os.environ.get("CUDA_VISIBLE_DEVICES"), os.getenv("KERAS_BACKEND"),\n'
     '      os.environ["TF_CPP_MIN_LOG_LEVEL"])\n', None),  # read only
])
def test_a_script_that_may_change_a_variable_read_at_import_is_named(source, changed):
    import ast
    assert warm_fork._sets_import_env(ast.parse(source), ENV) == changed


@pytest.mark.parametrize("source, first", [
    ("import logging\nlogging.basicConfig()\nimport tensorflow as tf\n", True),
    ("import tensorflow as tf\nimport logging\nlogging.basicConfig()\n", False),
    ("import logging\nfrom keras import layers\nlogging.basicConfig()\n", False),
    ("import logging\ndef main():\n    logging.basicConfig()\n    import tensorflow\nmain()\n",
     True),
    ("import logging\nlogging.getLogger().addHandler(logging.StreamHandler())\nimport parallax\n",
     True),
    ("import logging\nlogging.basicConfig()\n", True),  # what it imports may import TensorFlow
    ("import tensorflow as tf\nprint(1)\n", False),
    ("import sys\nsys.stderr = open('log.txt', 'w')\nimport tensorflow\n", True),
    ("import sys, tensorflow\nsys.stdout = open('log.txt', 'w')\n", False),
    ("import io, sys\nreal, sys.stderr = sys.stderr, io.StringIO()\nimport keras\n", True),
    ("import sys\nprint('x', file=sys.stderr)\nimport tensorflow\n", False),
])
def test_logging_set_up_before_tensorflows_import_is_told(source, first):
    import ast
    assert warm_fork._logs_first(ast.parse(source)) is first


def test_the_warm_processes_directory_must_be_this_users_private_one(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(0o700)
    assert warm_stub.private_refusal(str(mine)) is None
    mine.chmod(0o755)
    assert "has mode 755, not 700" in warm_stub.private_refusal(str(mine))
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert "not a directory" in warm_stub.private_refusal(str(link))
    assert "cannot use" in warm_stub.private_refusal(str(tmp_path / "missing"))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by all, not sticky: another user could swap what is in it
    (shared / "d").mkdir(0o700)
    assert "can be changed by other users" in warm_stub.private_refusal(str(shared / "d"))


def test_each_network_namespace_has_a_socket_of_its_own():
    space = os.readlink("/proc/self/ns/net")
    assert warm_stub.host_socket("/x/fork.sock") == \
        "/x/fork.sock-" + "".join(c for c in space if c.isdigit())
