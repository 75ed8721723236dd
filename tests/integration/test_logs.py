"""Logging (parallax.runtime.logs): levels, PARALLAX_LOG_LEVEL, --log-level on every command, the
server's format and its per-shard lines at DEBUG, and the filter of TensorFlow's start-up
noise, which drops exactly the known lines."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallax.client.local_cluster import LocalCluster
from parallax.env import LOG_LEVEL_ENV
from parallax.errors import ConfigError
from parallax.protocol.specs import TableSpec
from parallax.runtime import logs

PARALLAX = str(Path(sys.executable).parent / "parallax")
FFT = (b"2026-12-01 06:40:08.830848: E external/local_xla/xla/stream_executor/cuda/"
       b"cuda_fft.cc:485] Unable to register cuFFT factory: Attempting to register factory "
       b"for plugin cuFFT when one has already been registered")
DNN = (b"E0000 00:00:1718000000.123456   12345 cuda_dnn.cc:8310] Unable to register cuDNN "
       b"factory: Attempting to register factory for plugin cuDNN when one has already been "
       b"registered")
BLAS = (b"[1]<stderr>:2026-12-01 06:40:08.851910: E external/local_xla/xla/stream_executor/"
        b"cuda/cuda_blas.cc:1452] Unable to register cuBLAS factory: Attempting to register "
        b"factory for plugin cuBLAS when one has already been registered")
DRIVERS = (b"2026-12-01 06:43:59.060657: I external/local_xla/xla/tsl/cuda/cudart_stub.cc:32] "
           b"Could not find cuda drivers on your machine, GPU will not be used.")
# TensorFlow's collectives, as a 2-worker `parallax run --collectives tensorflow` printed them
ABSL = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
SERVER = (b"[1]<stderr>:I0000 00:00:1796321534.628742   28074 grpc_server_lib.cc:464] Started "
          b"server with target: grpc://localhost:54155")
AGENT = (b"[0]<stderr>:I0000 00:00:1796321535.030241   28073 coordination_service_agent.cc:310]"
         b" Coordination agent has successfully connected.")
NOISE = [FFT, DNN, BLAS, DRIVERS, ABSL, b"[0]<stderr>:" + ABSL, SERVER, AGENT]
KEPT = [
    b"Epoch 1/3",
    b"[0]<stdout>:loss 0.25",
    # TensorFlow lines that are not the known ones stay
    b"2026-12-01 06:43:59.148592: I tensorflow/core/platform/cpu_feature_guard.cc:210] This "
    b"TensorFlow binary is optimized to use available CPU instructions",
    b"2026-12-01 06:44:00.109770: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] "
    b"TF-TRT Warning: Could not find TensorRT",
    FFT.replace(b"plugin cuFFT", b"plugin cuDNN"),  # mismatched plugin: not the known line
    FFT + b" (and more)",
    FFT.split(b"] ", 1)[1],  # the text without TensorFlow's header: a program's own line
    ABSL + b" (and more)",
    b"WARNING: All log messages are ours",
    SERVER.split(b"] ", 1)[1],  # the text without TensorFlow's header
    b"E0000 is not a header",
]


@pytest.mark.parametrize("line", NOISE)
def test_the_known_tensorflow_lines_are_noise(line):
    assert logs.worker_noise(line)
    assert logs.worker_noise(line + b"\r")


@pytest.mark.parametrize("line", KEPT)
def test_other_lines_are_not(line):
    assert not logs.worker_noise(line)


def _filtered(stream: bytes, size: int) -> bytes:
    noise = logs.NoiseFilter()
    out = b"".join(noise.feed(stream[i:i + size]) for i in range(0, len(stream), size))
    return out + noise.flush()


@pytest.mark.parametrize("size", [1, 3, 7, 64, 100_000])
def test_the_filter_drops_exactly_the_known_lines_however_the_stream_is_cut(size):
    lines = [NOISE[0], KEPT[0], NOISE[1], NOISE[2], *KEPT[1:], NOISE[3], *NOISE[4:], b"",
             b"last"]
    stream = b"\n".join(lines) + b"\n\rpartial progress 3/10"
    expected = b"\n".join(line for line in lines if line not in NOISE) + \
        b"\n\rpartial progress 3/10"
    assert _filtered(stream, size) == expected


def test_a_partial_line_passes_at_once_unless_it_may_be_tensorflows():
    noise = logs.NoiseFilter()
    assert noise.feed(b"Epoch 1/3 [===") == b"Epoch 1/3 [==="  # a progress bar: no wait
    assert noise.feed(b"===]\n2026-12-01 06:40") == b"===]\n"  # held: may be noise
    assert noise.feed(b":08.8: I x.cc:1] fine\n") == b"2026-12-01 06:40:08.8: I x.cc:1] fine\n"
    assert noise.feed(b"[1]<stderr>:WARN") == b""  # absl's preamble may follow
    assert noise.feed(ABSL[4:] + b"\nWARNING: mine") == b"WARNING: mine"


@pytest.mark.parametrize("text, level", [("debug", logging.DEBUG), ("INFO", logging.INFO),
                                         (" Warning ", logging.WARNING),
                                         ("critical", logging.CRITICAL)])
def test_levels_parse_in_any_case(text, level):
    assert logs.parse_level(text) == level
    assert logs.env_level({LOG_LEVEL_ENV: text}) == level


def test_a_bad_level_names_the_value_and_the_choices():
    with pytest.raises(ConfigError, match=r"PARALLAX_LOG_LEVEL='loud' is not a log level; use "
                                          r"one of debug, info, warning, error, critical"):
        logs.env_level({LOG_LEVEL_ENV: "loud"})
    assert logs.env_level({}) == logging.INFO


@pytest.fixture
def restore_logging(monkeypatch):
    """configure() changes both loggers and exports PARALLAX_LOG_LEVEL: undone after."""
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    loggers = [logging.getLogger(name) for name in (logs.LIBRARY, logs.SERVER)]
    saved = [(logger.level, list(logger.handlers)) for logger in loggers]
    yield
    for logger, (level, handlers) in zip(loggers, saved):
        logger.setLevel(level)
        logger.handlers[:] = handlers
    os.environ.pop(LOG_LEVEL_ENV, None)


def test_configure_sets_both_loggers_and_exports_the_level(restore_logging, capsys):
    library = logging.getLogger("parallax.test")
    assert logs.configure("warning") == logging.WARNING
    assert os.environ[LOG_LEVEL_ENV] == "warning"
    assert logging.getLogger("parallax_ps").level == logging.WARNING
    library.info("hidden")
    library.warning("shown")
    assert capsys.readouterr().err == "parallax: WARNING: shown\n"
    os.environ[LOG_LEVEL_ENV] = "debug"
    assert logs.configure() == logging.DEBUG  # no --log-level: the environment's
    library.info("the plan")
    assert capsys.readouterr().err == "the plan\n"  # INFO is the bare message, as before


ABSL_THEN_PARALLAX = (
    "import logging, parallax; from absl import logging as absl_logging; "
    "log = logging.getLogger('parallax.tf'); log.info('before'); "
    "absl_logging.warning('absl speaks');"  # TF's absl lines: absl calls basicConfig()
    "log.info('the plan'); log.warning('careful')")


def test_each_parallax_line_prints_once_after_absl_configures_the_root_logger():
    """TensorFlow logs through absl (e.g. when a dataset's auto_shard_policy is set), whose
    first line calls logging.basicConfig(): a root handler on stderr. Every parallax line
    then printed twice, ours and the root's; now the root's handler alone prints it."""
    done = _python(ABSL_THEN_PARALLAX)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "before"  # no root handler yet: ours, INFO as the bare message
    assert sum("the plan" in line for line in lines) == 1, lines
    assert sum("careful" in line for line in lines) == 1, lines


def _info_beside(root: logging.Handler) -> None:
    """A parallax INFO line logged with `root` on the root logger."""
    logging.root.addHandler(root)
    try:
        logs.configure("info")
        logging.getLogger("parallax.test").info("the plan")
    finally:
        logging.root.removeHandler(root)


def test_a_root_handler_elsewhere_does_not_silence_the_terminal(restore_logging, capsys):
    """A root handler writing to a file (or pytest's capture) leaves ours printing."""
    import io
    elsewhere = logging.StreamHandler(io.StringIO())
    _info_beside(elsewhere)
    assert capsys.readouterr().err == "the plan\n"
    assert elsewhere.stream.getvalue() == "the plan\n"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != LOG_LEVEL_ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**environ, **env}, timeout=60)


LIBRARY_USER = ("import logging, parallax; log = logging.getLogger('parallax'); "
                "log.debug('d'); log.info('i'); log.warning('w')")


@pytest.mark.parametrize("env, expected", [
    ({}, "i\nparallax: WARNING: w\n"),  # INFO on stderr without any setup
    ({LOG_LEVEL_ENV: "warning"}, "parallax: WARNING: w\n"),
    ({LOG_LEVEL_ENV: "debug"}, "parallax: DEBUG: d\ni\nparallax: WARNING: w\n"),
    ({LOG_LEVEL_ENV: "loud"}, "parallax: WARNING: PARALLAX_LOG_LEVEL='loud' is not a log "
                              "level; use one of debug, info, warning, error, critical; "
                              "logging at info\ni\nparallax: WARNING: w\n"),
])
def test_importing_parallax_logs_at_the_environments_level(env, expected):
    done = _python(LIBRARY_USER, **env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == expected and done.stdout == ""


@pytest.mark.parametrize("command", ["run", "server", "demo", "ps-demo", "status", "k8s",
                                     "bench"])
def test_every_command_takes_log_level(command):
    done = subprocess.run([PARALLAX, command, "--log-level", "loud"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "argument --log-level: invalid choice: 'loud'" in done.stderr


def test_a_bad_environment_level_is_one_warning_and_info_from_a_command():
    server = subprocess.Popen([PARALLAX, "server"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, LOG_LEVEL_ENV: "loud"})
    try:
        first = server.stdout.readline()
        before = [server.stdout.readline()]  # INFO lines of its start (the data path), READY
        while before[-1] and not before[-1].startswith("PARALLAX_SERVER_READY ") \
                and len(before) < 5:
            before.append(server.stdout.readline())
    finally:
        server.terminate()
        rest = server.communicate(timeout=30)[0]
    assert first == ("parallax: WARNING: PARALLAX_LOG_LEVEL='loud' is not a log level; use one "
                     "of debug, info, warning, error, critical; logging at info\n")
    assert before[-1].startswith("PARALLAX_SERVER_READY "), before
    assert all(" parallax-ps INFO " in line for line in before[:-1]), before
    assert "parallax-ps INFO shutting down" in rest and "WARNING" not in rest


def _created_lines(cluster: LocalCluster) -> list[str]:
    from parallax.client import PSClient
    with PSClient(cluster.addresses) as client:
        client.create_table(TableSpec("logs.v0.t", dim=4, vocabulary_size=10, shard_count=2))
    cluster.stop()
    return [line for server in cluster.servers for line in server.lines]


@pytest.mark.parametrize("args, env, shown", [
    ([], {}, False),                                     # INFO: no per-shard lines
    (["--log-level", "debug"], {}, True),
    ([], {LOG_LEVEL_ENV: "debug"}, True),
    (["--log-level", "info"], {LOG_LEVEL_ENV: "debug"}, False),  # the flag wins
])
def test_per_shard_lines_are_debug_and_the_server_names_the_level(args, env, shown,
                                                                  monkeypatch):
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    lines = _created_lines(LocalCluster(1, extra_args=args).start())
    created = [line for line in lines if "created table 'logs.v0.t' shard" in line]
    assert len(created) == (2 if shown else 0), lines
    assert all(" parallax-ps DEBUG created table" in line for line in created)
    assert any(" parallax-ps INFO shutting down" in line for line in lines), lines


def test_a_root_handler_that_filters_parallax_out_does_not_silence_it(restore_logging, capsys):
    """A root handler on the terminal that drops parallax's records leaves them to ours."""
    import sys as _sys
    root = logging.StreamHandler(_sys.stderr)
    root.addFilter(lambda record: not record.name.startswith("parallax"))
    _info_beside(root)
    assert capsys.readouterr().err == "the plan\n"
