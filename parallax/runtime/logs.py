"""Logging: the one owner of the setup of parallax's two loggers.

Library code logs to `logging.getLogger("parallax")` (the parameter servers' code to
`logging.getLogger("parallax_ps")`) and never calls `print()` for a message. Importing
`parallax` gives the "parallax" logger a handler that writes to stderr, so the plan lines
and warnings show without any setup, as they did: INFO as the bare message, other levels as
`parallax: WARNING: message`. Messages still propagate to the root logger, and a message
that a handler of the root logger writes to the same terminal (stderr or stdout) is left to
that handler: once per event, in the application's format. That covers your own
`logging.basicConfig()` and the one absl makes on TensorFlow's first absl log line (which
printed every parallax line twice). To send parallax's messages only through your own
logging, drop ours with `logging.getLogger("parallax").handlers.clear()`.

The level: `--log-level` on every command, else PARALLAX_LOG_LEVEL, else INFO. A command
exports its level in PARALLAX_LOG_LEVEL, so the servers and workers it starts follow it.
Per-shard lines ("created table ... shard N") are DEBUG.

`worker_noise(line)` tells TensorFlow's known start-up lines that TF_CPP_MIN_LOG_LEVEL=2 does
not hide (cuFFT/cuDNN/cuBLAS "Unable to register", "Could not find cuda drivers", and with
TensorFlow's collectives each worker's "Started server with target", "Coordination agent
has successfully connected" and absl's "All log messages before absl::InitializeLog()"
preamble); the launcher drops exactly those from the workers' output (`NoiseFilter`).
"""
from __future__ import annotations

import logging
import os
import re
import sys

from parallax.env import LOG_LEVEL_ENV
from parallax.errors import ConfigError

LIBRARY, SERVER = "parallax", "parallax_ps"
LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LEVEL = "info"
SERVER_FORMAT = "%(asctime)s parallax-ps %(levelname)s %(message)s"


def parse_level(text: str, source: str = LOG_LEVEL_ENV) -> int:
    """The logging level a name stands for (any case); ConfigError names the choices."""
    name = text.strip().lower()
    if name not in LEVELS:
        raise ConfigError(f"{source}={text!r} is not a log level; use one of "
                          f"{', '.join(LEVELS)}")
    return getattr(logging, name.upper())


def env_level(environ=None) -> int:
    """PARALLAX_LOG_LEVEL's level, INFO when unset."""
    environ = os.environ if environ is None else environ
    return parse_level(environ.get(LOG_LEVEL_ENV) or DEFAULT_LEVEL)


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test's capture, a redirect), unless a
    handler of the root logger writes the same record to the terminal (`_root_prints`)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def filter(self, record: logging.LogRecord):
        if _root_prints(record):
            return False
        return super().filter(record)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _LibraryFormat(logging.Formatter):
    """INFO as the bare message (the plan lines); other levels `parallax: LEVEL: message`."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno == logging.INFO:
            return text
        return f"parallax: {record.levelname}: {text}"


def _terminal(handler: logging.Handler) -> bool:
    """Whether a handler writes to this process's stderr or stdout (absl's handler holds
    its stream one level down)."""
    stream = getattr(handler, "stream", None)
    if stream is None and hasattr(handler, "python_handler"):
        stream = getattr(handler.python_handler, "stream", None)
    if stream is None or getattr(stream, "closed", False):
        return False
    return stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)


def _root_prints(record: logging.LogRecord) -> bool:
    """Whether the record also reaches a root handler that writes it to the terminal."""
    logger = logging.getLogger(record.name)
    while logger.parent is not None:  # up to the root, as logging propagates
        if not logger.propagate:
            return False
        logger = logger.parent
    return any(_terminal(h) and record.levelno >= h.level and h.filter(record)
               for h in logging.root.handlers)


def _own_handler(logger: logging.Logger) -> logging.Handler | None:
    return next((h for h in logger.handlers if isinstance(h, _Stderr)), None)


def _attach(name: str, formatter: logging.Formatter, level: int) -> None:
    logger = logging.getLogger(name)
    handler = _own_handler(logger)
    if handler is None:
        handler = _Stderr()
        logger.addHandler(handler)
    handler.setFormatter(formatter)
    logger.setLevel(level)


def _env_level_or_info() -> tuple[int, ConfigError | None]:
    """PARALLAX_LOG_LEVEL's level; a bad value gives INFO (and the error, to warn about)."""
    try:
        return env_level(), None
    except ConfigError as exc:
        return logging.INFO, exc


def install() -> None:
    """At `import parallax`: the "parallax" logger's stderr handler and its level from
    PARALLAX_LOG_LEVEL (a bad value: INFO, and a warning naming it)."""
    if _own_handler(logging.getLogger(LIBRARY)) is not None:
        return
    level, problem = _env_level_or_info()
    _attach(LIBRARY, _LibraryFormat(), level)
    if problem is not None:
        logging.getLogger(LIBRARY).warning("%s; logging at info", problem)


def configure(level: str | None = None, *, server: bool = False) -> int:
    """A command's setup: `level` (its --log-level), else PARALLAX_LOG_LEVEL (a bad value:
    INFO, warned about by `install`), else INFO, on both loggers (with `server`, both in the
    server's format, with the level name); exported in PARALLAX_LOG_LEVEL for the processes
    the command starts. Returns the level."""
    number = (parse_level(level, "--log-level") if level is not None
              else _env_level_or_info()[0])
    name = logging.getLevelName(number).lower()
    formatter = logging.Formatter(SERVER_FORMAT) if server else _LibraryFormat()
    for logger in (LIBRARY, SERVER):
        _attach(logger, formatter, number)
    os.environ[LOG_LEVEL_ENV] = name
    return number


def add_argument(parser) -> None:
    """`--log-level` on a command's argparse parser (see `configure`)."""
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=None,
                        metavar="LEVEL",
                        help=f"{', '.join(LEVELS)} (default: ${LOG_LEVEL_ENV}, else "
                             f"{DEFAULT_LEVEL}); the processes this command starts follow it")


def parse(parser, argv):
    """A command's arguments: `--log-level` added to `parser`, `argv` parsed, logging set up
    (`configure`); returns argparse's namespace."""
    add_argument(parser)
    args = parser.parse_args(argv)
    configure(args.log_level)
    return args


# ---------------------------------------------------------------------------------------
# TensorFlow's start-up noise in the workers' output

_RANK_PREFIX = rb"(?:\[\d+\]<std(?:out|err)>:)?"  # horovodrun's per-line prefix
_TF_HEADER = (rb"(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [EWI] "  # TF's own log format
              rb"|[EWI]\d{4} [\d:]+\.\d+ +\d+ )"           # absl's
              rb"\S+\.cc:\d+\] ")
_NOISE = re.compile(
    rb"^" + _RANK_PREFIX + rb"(?:" + _TF_HEADER +
    rb"(?:Unable to register (cuFFT|cuDNN|cuBLAS) factory: Attempting to register factory "
    rb"for plugin \1 when one has already been registered"
    rb"|Could not find cuda drivers on your machine, GPU will not be used\."
    # TensorFlow's collectives (`--collectives tensorflow`): each worker's server and its
    # coordination agent say they started, the first line of the process's absl log
    rb"|Started server with target: grpc://\S+"
    rb"|Coordination agent has successfully connected\.)"
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    rb"STDERR)\r?$")
_ABSL_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog()"
# a partial line that may still become one of them: held until its newline
_MAYBE_NOISE = re.compile(rb"^\[\d*(?:\]<?[a-z]*>?:?)?$"  # a part of horovodrun's prefix
                          rb"|^" + _RANK_PREFIX +
                          rb"(?:\d{1,4}$|\d{4}-|[EWI]\d{0,4}$|[EWI]\d{4} )")


def _maybe_noise(held: bytes) -> bool:
    """Whether a partial line may still become a known one (then it waits for its newline)."""
    if _MAYBE_NOISE.match(held):
        return True
    text = re.sub(rb"^" + _RANK_PREFIX, b"", held)
    return len(text) > 1 and _ABSL_PREAMBLE.startswith(text[:len(_ABSL_PREAMBLE)])


def worker_noise(line: bytes) -> bool:
    """Whether a line (no newline) is one of TensorFlow's known start-up lines."""
    return _NOISE.match(line) is not None


class NoiseFilter:
    """Feed it a stream's chunks as they come; it returns what to write: everything but the
    known TensorFlow lines, partial lines too, except one that looks like the start of a
    TensorFlow log line, which waits for its newline."""

    def __init__(self) -> None:
        self._held = b""        # the start of the current line, not written yet
        self._passing = False   # the current line's start is written: the rest passes

    def feed(self, chunk: bytes) -> bytes:
        out = []
        for piece in re.split(rb"(?<=\n)", chunk):
            if not piece:
                continue
            complete = piece.endswith(b"\n")
            if self._passing:
                out.append(piece)
                self._passing = not complete
                continue
            self._held += piece
            if complete and worker_noise(self._held[:-1]):
                self._held = b""
            elif complete or not _maybe_noise(self._held):
                out.append(self._held)
                self._passing, self._held = not complete, b""
        return b"".join(out)

    def flush(self) -> bytes:
        """What is still held (the stream ended without a newline)."""
        held, self._held = self._held, b""
        return held
