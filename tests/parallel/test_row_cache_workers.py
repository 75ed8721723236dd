"""A row cache of staleness 0 trains exactly as no cache, on 2 workers (`parallax run -np 2`,
2 servers on loopback) and on one worker with embedded servers: the same weights within
1e-7 and the same per-step losses, for a Keras Embedding model under fit, a table group
in a custom loop, and a run resharded twice midway (which invalidates the cache)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from parallax.env import HOROVOD_CYCLE_TIME_ENV
from test_strategy_equivalence import _run

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "strategy_worker.py"
PARALLAX = str(Path(sys.executable).parent / "parallax")
PAIRS = [("keras-sgd-fit", "keras-sgd-fit-cache0"),
         ("three-adagrad-custom", "three-adagrad-custom-cache0"),
         ("keras-adagrad-fit-reshard", "keras-adagrad-fit-cache0reshard")]
CASES = ",".join(c for pair in PAIRS for c in pair)

pytestmark = pytest.mark.multiprocess


def _run_job(command: list[str]) -> str:
    return _run(command, timeout=900, env={k: v for k, v in os.environ.items()
                                           if k != HOROVOD_CYCLE_TIME_ENV})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    base = tmp_path_factory.mktemp("row-cache")
    worker = [sys.executable, str(WORKER), "--steps", "20", "--batch", "16", "--setup",
              "parallax", "--cases", CASES]
    two = _run_job([PARALLAX, "run", "-np", "2", "--servers", "2", "--", *worker, "--out",
                str(base / "two")])
    one = _run_job(worker + ["--out", str(base / "one")])
    return {"two": (base / "two", two), "one": (base / "one", one)}


def _histories(output: str) -> dict[tuple[str, str], dict]:
    found = {}
    for line in output.splitlines():
        if line.startswith("HISTORY "):
            _, rank, case, history = line.split(" ", 3)
            found[(rank, case)] = json.loads(history)
    return found


@pytest.mark.parametrize("workers", ["two", "one"])
@pytest.mark.parametrize("off,on", PAIRS)
def test_staleness_zero_trains_exactly_as_no_cache(runs, workers, off, on):
    out, output = runs[workers]
    want, got = np.load(out / f"{off}.npz"), np.load(out / f"{on}.npz")
    assert len(want.files) == len(got.files)
    for key, other in zip(want.files, got.files):
        a, b = want[key], got[other]
        assert a.shape == b.shape, key
        assert np.abs(a - b).max() <= 1e-7 * max(1.0, np.abs(a).max()), (off, key)
    histories = _histories(output)
    for (rank, case), history in histories.items():
        if case == off:
            assert histories[(rank, on)] == history  # every step's loss, bit for bit
