"""The installed toolchain is the one the project is built on: TF 2.17.1 and Horovod with gloo."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def test_tensorflow_and_grpc_versions():
    import grpc
    import tensorflow as tf
    assert tf.__version__ == "2.17.1"
    assert grpc.__version__.startswith("1.62.")


@pytest.mark.multiprocess
def test_horovodrun_gloo_allreduces_across_two_ranks():
    result = subprocess.run(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
         str(Path(__file__).parent / "hvd_allreduce.py")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sums = re.findall(r"HVD rank=(\d) size=2 sum=\[1\.0, 2\.0\]", result.stdout)
    assert sorted(sums) == ["0", "1"], result.stdout[-3000:]
