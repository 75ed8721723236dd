"""Measurement windows inside one benchmark run, shared by every system.

A run warms up, calibrates its step time, and then times a few windows of equal step counts.
Windows are wall-clock (`time.time()`) intervals, because the harness matches them against
the byte and CPU counters it samples from outside the processes (one clock: every namespace
shares it). Synchronous systems must run the same number of steps on every worker, or the
last collective would wait forever, so the step count per window is agreed once with a
collective maximum (`Trainer.agree_max`) instead of each worker stopping on its own clock.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

RESULT_PREFIX = "BENCH_RESULT "
READY_LINE = "BENCH_STARTED"   # printed after the first step, before the gate is waited for
GATE_ENV = "PARALLAX_BENCH_GATE"  # a file the harness creates once every host is throttled
GATE_TIMEOUT_S = 900.0
GATE_POLL_S = 0.02
CODE_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout parallax came from here
#   (a Python started in a checkout imports that checkout's parallax ahead of PYTHONPATH)


@dataclass(frozen=True)
class WindowConfig:
    warmup_steps: int = 3
    calibration_steps: int = 3
    windows: int = 3
    window_seconds: float = 3.0
    min_window_steps: int = 2

    def args(self) -> list[str]:
        """The same configuration as worker command-line flags."""
        return ["--warmup-steps", str(self.warmup_steps),
                "--calibration-steps", str(self.calibration_steps),
                "--windows", str(self.windows), "--window-seconds", str(self.window_seconds),
                "--min-window-steps", str(self.min_window_steps)]


@dataclass(frozen=True)
class Window:
    t0: float
    t1: float
    steps: int
    samples: int


@dataclass
class Trainer:
    """One system's training loop, as the measurement needs it.

    step: one global step (every worker one local batch); blocks until done, except under
      asynchronous coordinators (TF's ClusterCoordinator), whose `sync` waits for the queue.
    agree_max: a collective maximum over the workers (identity with one worker/coordinator).
    losses: every step's loss so far (rank 0's local batch), in order: the loss curve.
    counters: counts that only grow (rows pulled, cache hits...); the run reports how much
      each grew over the measured windows.
    """

    step: Callable[[], object]
    rank: int
    workers: int
    global_batch: int
    agree_max: Callable[[float], float] = lambda x: x
    sync: Callable[[], None] = lambda: None
    loss: Callable[[], float] = field(default=lambda: float("nan"))
    close: Callable[[], None] = lambda: None
    losses: Callable[[], list[float]] = list
    counters: Callable[[], dict[str, float]] = dict


def wait_for_gate(path: str | None, timeout: float = GATE_TIMEOUT_S, out=sys.stdout) -> None:
    """Under a harness that throttles CPU after start-up (`GATE_ENV` set): say so, then wait
    until it has created `path` (every host held to its quota); nothing without a path."""
    if not path:
        return
    print(READY_LINE, file=out, flush=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the benchmark harness did not create {path} within "
                               f"{timeout:.0f} s of this process's first step")
        time.sleep(GATE_POLL_S)


def run_windows(trainer: Trainer, config: WindowConfig,
                counted: dict[str, float] | None = None,
                gate: Callable[[], None] = lambda: None) -> list[Window]:
    """The timed windows; `counted`, when given, receives how much each of the trainer's
    counters grew over them. `gate` runs after the first warm-up step (its tracing and first
    pulls are start-up): the harness throttles CPU there (`wait_for_gate`)."""
    if config.warmup_steps:
        trainer.step()
        trainer.sync()
    gate()
    for _ in range(config.warmup_steps - 1):
        trainer.step()
    trainer.sync()
    per_step = _calibrate(trainer, config)
    steps = int(trainer.agree_max(float(max(config.min_window_steps,
                                            math.ceil(config.window_seconds / per_step)))))
    windows, before = [], trainer.counters() if counted is not None else {}
    for _ in range(config.windows):
        t0 = time.time()
        for _ in range(steps):
            trainer.step()
        trainer.sync()
        t1 = time.time()
        windows.append(Window(t0, t1, steps, steps * trainer.global_batch))
    if counted is not None:
        after = trainer.counters()
        counted.update({key: after[key] - before.get(key, 0) for key in after})
    return windows


def _calibrate(trainer: Trainer, config: WindowConfig) -> float:
    """Seconds per step, from rounds of doubling length until a quarter window has passed:
    under an asynchronous coordinator a short round mostly measures the queue's latency.
    Workers agree on each round's elapsed time (the slowest's), so they all stop after the
    same round: one more round on one worker alone would wait forever for the others."""
    start, done, batch = time.time(), 0, max(1, config.calibration_steps)
    while True:
        for _ in range(batch):
            trainer.step()
        trainer.sync()
        done += batch
        elapsed = trainer.agree_max(time.time() - start)
        if elapsed >= config.window_seconds / 4:
            return max(elapsed / done, 1e-6)
        batch *= 2


def emit(system: str, workload: str, trainer: Trainer, windows: list[Window],
         out=sys.stdout, counted: dict[str, float] | None = None,
         data_path: str | None = None) -> None:
    """The line the harness parses: printed by rank 0 (the coordinator under TF PS);
    `data_path`: parallax's (`parallax.native.describe()`), None for other systems. `code`:
    the checkout this process imported parallax from (an A/B of two checkouts must see two)."""
    record = {"system": system, "workload": workload, "workers": trainer.workers,
              "global_batch": trainer.global_batch, "loss": trainer.loss(),
              "windows": [asdict(w) for w in windows], "losses": list(trainer.losses()),
              "counters": dict(counted or {}), "data_path": data_path, "code": CODE_ROOT}
    print(RESULT_PREFIX + json.dumps(record), file=out, flush=True)


def parse_result(line: str) -> dict | None:
    """The record of a BENCH_RESULT line, or None for any other line."""
    line = line.strip()
    marker = line.find(RESULT_PREFIX)
    if marker < 0:
        return None
    return json.loads(line[marker + len(RESULT_PREFIX):])
