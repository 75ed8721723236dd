"""Automatic restarts of a failed job: `parallax run --max-restarts N`.

One attempt of a job ends in an `Outcome`: its exit code and why it ended. A failure (a
worker exited non-zero or was killed, a parameter server died or stopped answering health
checks) is followed by a restart of every worker, at most N times in all; the servers start
again too when one of them failed (`server_failed`), and otherwise keep running, the job's
tables dropped from them. A clean exit, a signal the user sent to the launcher, and a
configuration error are never restarted.

Restarted workers find their attempt in PARALLAX_RESTART_COUNT (0 for the first run, as
torchrun's TORCHELASTIC_RESTART_COUNT) and resume from the last checkpoint their script
restores (`tf.train.CheckpointManager`, Keras `BackupAndRestore`): that brings back the dense
variables and, through the strategy, the servers' tables with their optimizer slots and step.
Work since that checkpoint is done again, so a failure costs at most one checkpoint interval
plus the restart itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from parallax.errors import ConfigError

RESTART_DELAY_S = 1.0  # default pause before a restart: let ports and sockets close


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: `code` (the job's exit code), `cause` (a sentence, "" for a
    clean exit), whether a restart can help (`restartable`), and whether the workers stopped
    at a checkpoint for a new worker count (`rescale`: an elastic job goes on, using no
    restart)."""

    code: int
    cause: str = ""
    restartable: bool = False
    rescale: bool = False
    server_failed: bool = False  # a parameter server died or hung: they all start again

    @classmethod
    def failed(cls, code: int, cause: str, server_failed: bool = False) -> "Outcome":
        return cls(code, cause, restartable=code != 0, server_failed=server_failed)


class RestartBudget:
    """At most `max_restarts` restarts, `delay_s` apart (None: RESTART_DELAY_S after a
    server's failure, whose replacements take ports again, none after a worker's, whose
    servers keep running); `should_restart` says whether the attempt that just ended gets
    another, and logs why through `say`."""

    def __init__(self, max_restarts: int, delay_s: float | None = RESTART_DELAY_S,
                 say: Callable[[str], None] = print) -> None:
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts {max_restarts} must be >= 0 (0: no restarts)")
        if delay_s is not None and not delay_s >= 0:
            raise ConfigError(f"--restart-delay {delay_s} must be >= 0 seconds")
        self.max_restarts, self.delay_s, self._say = max_restarts, delay_s, say
        self.restarts = 0
        self.causes: list[str] = []

    def should_restart(self, outcome: Outcome) -> bool:
        if not outcome.restartable:
            return False
        if self.restarts >= self.max_restarts:
            if self.max_restarts:
                self._say(f"not restarting: all {self.max_restarts} restart(s) of "
                          f"--max-restarts are used; the job exits with {outcome.code}")
            return False
        self.restarts += 1
        self.causes.append(outcome.cause)
        delay = self.delay_s if self.delay_s is not None else \
            RESTART_DELAY_S if outcome.server_failed else 0.0
        self._say(f"restart {self.restarts} of {self.max_restarts} in {delay:g}s, "
                  f"after: {outcome.cause}; "
                  + ("every server and worker starts again and the workers resume"
                     if outcome.server_failed else
                     "the workers start again (the servers keep running) and resume")
                  + " from their last checkpoint")
        time.sleep(delay)
        return True
