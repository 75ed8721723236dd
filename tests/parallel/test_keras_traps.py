"""Issue 29's Keras traps on 2 workers, against one process on the same data: `evaluate` and
`predict` covering every row (a partial last global batch, one worker's part empty) in the
input's order; a baseline `evaluate`/`predict` before `fit`; `fit` with `validation_data`
and `steps_per_execution=4`; a model built outside `strategy.scope()`; a dataset split
by hand; one `BackupAndRestore` directory for every worker.
One launch per collectives backend (Horovod, TensorFlow's) and one single process, all
running tests/helpers/keras_traps_worker.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "helpers" / "keras_traps_worker.py"
PARALLAX = str(Path(sys.executable).parent / "parallax")
BACKENDS = ("horovod", "tensorflow")

pytestmark = pytest.mark.multiprocess


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"})
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("keras-traps")
    _run([sys.executable, str(WORKER), "--out", str(base / "one")])
    for backend in BACKENDS:
        _run([PARALLAX, "run", "-np", "2", "--servers", "2", "--collectives", backend, "--",
              sys.executable, str(WORKER), "--out", str(base / backend)])
    return {name: base / name for name in ("one", *BACKENDS)}


def _load(folder: Path, rank: int) -> tuple[dict, dict]:
    arrays = np.load(folder / f"rank{rank}.npz")
    return dict(arrays), json.loads((folder / f"rank{rank}.json").read_text())


def _phase(summary: dict, phase: str) -> None:
    assert f"{phase}_error" not in summary, summary[f"{phase}_error"]


def _same_predictions(want: dict, got: dict, keys) -> None:
    for key in keys:
        rows = 201 if "odd" in key else 193
        assert got[key].shape == want[key].shape == (rows, 1), key
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [0, 1])
def test_predict_covers_every_row_in_order_as_one_process(results, backend, rank):
    """201 rows (last global batch 9: parts of 4 and 5) and 193 rows (last global batch 1:
    worker 0's part empty): every worker's predict returns every row, in the input's order,
    equal to one process's."""
    want, want_summary = _load(results["one"], 0)
    got, summary = _load(results[backend], rank)
    _phase(want_summary, "rows")
    _phase(summary, "rows")
    assert summary["workers"] == 2 and summary["table_on_servers"] == "ps"
    assert summary["collectives"] == {"horovod": "HorovodWorkers",
                                      "tensorflow": "TensorFlowWorkers"}[backend]
    _same_predictions(want, got, ("odd_pred", "one_pred"))
    assert got["on_batch_pred"].shape == (5, 1)  # predict_on_batch: this worker's rows only
    np.testing.assert_allclose(got["on_batch_pred"], want["on_batch_pred"], rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [0, 1])
def test_evaluate_counts_every_row_as_one_process(results, backend, rank):
    """Loss and metric equal one process's on the same rows (no row dropped or counted
    twice)."""
    _, want = _load(results["one"], 0)
    _, got = _load(results[backend], rank)
    _phase(want, "rows")
    _phase(got, "rows")
    for key in ("odd_eval", "one_eval"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_baseline_evaluate_and_predict_before_fit(results, backend, rank):
    """Traced before the plan, Keras' evaluate and predict functions are traced again once
    the table moved to the servers: before and after fit, as one process."""
    want, want_summary = _load(results["one"], 0)
    got, summary = _load(results[backend], rank)
    _phase(want_summary, "baseline")
    _phase(summary, "baseline")
    keys = [f"{when}_{name}" for when in ("before", "after") for name in ("odd", "one")]
    _same_predictions(want, got, [f"{k}_pred" for k in keys])
    for key in keys:
        np.testing.assert_allclose(summary[f"{key}_eval"], want_summary[f"{key}_eval"],
                                   rtol=1e-5, err_msg=key)
    assert np.abs(got["after_odd_pred"] - got["before_odd_pred"]).max() > 1e-3  # trained


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_with_validation_and_steps_per_execution(results, backend):
    """steps_per_execution=4 with validation_data on 2 workers trains, validates every row,
    and both workers see one process's history."""
    _, want = _load(results["one"], 0)
    _phase(want, "multistep")
    summaries = [_load(results[backend], rank)[1] for rank in (0, 1)]
    for summary in summaries:
        _phase(summary, "multistep")
    histories = [summary["multistep_history"] for summary in summaries]
    assert histories[0] == histories[1]
    assert sorted(histories[0]) == ["loss", "mae", "val_loss", "val_mae"]
    for key, values in histories[0].items():
        np.testing.assert_allclose(values, want["multistep_history"][key], rtol=1e-5,
                                   err_msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_built_outside_the_scope_is_refused_in_a_job(results, backend):
    """Each worker would train its own copy on all the data: refused, naming the fix. One
    process started by hand trains it as plain Keras (with a warning)."""
    for rank in (0, 1):
        outcome = _load(results[backend], rank)[1]["outside"]
        assert outcome.startswith("ConfigError: model ") and \
            "built outside strategy.scope()" in outcome and \
            "inside `with strategy.scope():`" in outcome, outcome
    assert _load(results["one"], 0)[1]["outside"] == "trained"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dataset_split_by_hand_is_refused_in_a_job(results, backend):
    """Horovod's `.shard(size, rank).batch(local)` left in would be split again (each worker
    training on half its part): refused on every worker, naming the fix."""
    for rank in (0, 1):
        outcome = _load(results[backend], rank)[1]
        _phase(outcome, "presharded")
        assert outcome["presharded"].startswith(
            f"ConfigError: the dataset is already split among the 2 workers (`.shard(2, "
            f"{rank})`") and "global batch size" in outcome["presharded"], outcome["presharded"]
    assert _load(results["one"], 0)[1]["presharded"] == "trained"


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_backup_directory_for_every_worker_is_refused(results, backend):
    """Keras 3's BackupAndRestore on every worker, one directory: a worker deleted it at the
    end of fit while the chief still saved (FileNotFoundError). Refused at the start of fit
    on every worker, naming the directory and the per-worker one."""
    for rank in (0, 1):
        outcome = _load(results[backend], rank)[1]
        _phase(outcome, "backup")
        assert outcome["backup"].startswith("ConfigError: BackupAndRestore's directory ") and \
            "backup' is given to workers [0, 1]" in outcome["backup"] and \
            'f"worker-{strategy.worker.rank}"' in outcome["backup"], outcome["backup"]
    assert _load(results["one"], 0)[1]["backup"] == "trained"
