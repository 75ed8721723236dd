"""The installed toolchain is the one the project is built on: TF 2.17.1 and Horovod with gloo."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _pinned(name: str) -> str:
    requirements = Path(__file__).resolve().parents[2] / "requirements" / "base.txt"
    for line in requirements.read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{name} is not pinned in {requirements}")


def test_installed_versions_are_the_pinned_ones():
    import google.protobuf
    import grpc
    import grpc_tools
    import tensorflow as tf
    from importlib.metadata import version
    assert tf.__version__ == _pinned("tensorflow") == "2.17.1"
    assert grpc.__version__ == _pinned("grpcio")
    assert version("grpcio-tools") == _pinned("grpcio-tools")
    assert version("keras") == _pinned("keras")  # parallax relies on Keras 3 internals
    assert google.protobuf.__version__.startswith("4.25.")
    assert grpc_tools is not None


@pytest.mark.multiprocess
def test_horovodrun_gloo_allreduces_across_two_ranks():
    result = subprocess.run(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
         str(Path(__file__).resolve().parents[1] / "helpers" / "hvd_allreduce.py")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sums = re.findall(r"HVD rank=(\d) size=2 sum=\[1\.0, 2\.0\]", result.stdout)
    assert sorted(sums) == ["0", "1"], result.stdout[-3000:]
