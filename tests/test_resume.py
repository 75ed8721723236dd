"""Exact resume through the standard APIs (issue 13, defects 2 and 11), on 2 workers and 2
real servers on loopback.

Each case trains 12 steps three ways, every job a fresh `parallax run` (new servers, one
data directory for all):
- full:   12 steps without a stop;
- stop:   6 steps, checkpointed (CheckpointManager in the MWMS custom-loop tutorial's shape,
          or Keras BackupAndRestore every epoch), then the job ends;
- resume: a new job restores that checkpoint and trains steps 6-12.
Resumed losses and predictions must equal the uninterrupted job's within 1e-6. Before the
fix the optimizer slots of the tables restarted from their initial values (Adagrad diverged)
and the custom loop could not even name its chief (`strategy.cluster_resolver` was None).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "resume_worker.py"
PARALLAX = str(Path(sys.executable).parent / "parallax")
CASES = ["custom-sgd", "custom-adagrad", "fit-sgd", "fit-adagrad"]
STEPS, STOP = 12, 6

pytestmark = pytest.mark.multiprocess


def _job(data_dir: Path, out: Path, phase: str, *extra: str) -> None:
    command = [PARALLAX, "run", "-np", "2", "--servers", "2", "--data-dir", str(data_dir),
               "--", sys.executable, str(WORKER), "--cases", ",".join(CASES), "--phase",
               phase, "--steps", str(STEPS), "--out", str(out), *extra]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("resume")
    _job(base / "data", base / "full", "full")
    _job(base / "data", base / "resumed", "stop", "--stop-at", str(STOP))
    _job(base / "data", base / "resumed", "resume")
    return {"full": base / "full", "resumed": base / "resumed"}


def _result(runs, run: str, case: str, phase: str) -> dict:
    return json.loads((runs[run] / case / f"{phase}.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_resumed_training_equals_uninterrupted_training(runs, case):
    full = _result(runs, "full", case, "full")
    stopped = _result(runs, "resumed", case, "stop")
    resumed = _result(runs, "resumed", case, "resume")
    done = len(stopped["losses"])
    assert done == (STOP if case.startswith("custom") else STOP // 3)
    losses = np.array(stopped["losses"] + resumed["losses"])
    assert losses.shape == np.shape(full["losses"])
    np.testing.assert_allclose(losses, full["losses"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(resumed["prediction"], full["prediction"], rtol=0, atol=1e-6)
    assert not np.allclose(stopped["prediction"], full["prediction"], atol=1e-3)  # it trained


def test_cluster_resolver_names_the_chief_and_the_cluster(runs):
    result = _result(runs, "full", "custom-sgd", "full")
    assert result["task"] == ["worker", 0]
    cluster = result["cluster"]
    assert len(cluster["worker"]) == 2 and len(cluster["ps"]) == 2
    assert all(address.startswith("127.0.0.1:") for address in cluster["ps"])
    # Only the chief's CheckpointManager directory exists; worker 1 saved into a temporary
    # one and removed it, as the tutorial does.
    assert sorted(p.name for p in (runs["full"] / "custom-sgd").iterdir()) == \
        ["ckpt", "full.json"]
