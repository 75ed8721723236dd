"""The committed generated code is exactly what the pinned protoc makes from proto/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import google.protobuf

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"]


def test_generated_code_matches_the_proto(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", "parallax/ps/v1/ps.proto"],
                   check=True, cwd=ROOT)
    for name in GENERATED:
        fresh = (tmp_path / "parallax/ps/v1" / name).read_text()
        committed = (ROOT / "parallax/ps/v1" / name).read_text()
        assert fresh == committed, (f"parallax/ps/v1/{name} is stale; regenerate with "
                                    f"scripts/gen_proto.sh")


def test_runtime_is_the_protobuf_tensorflow_brings():
    assert google.protobuf.__version__.startswith("4.25."), google.protobuf.__version__


def test_tensors_travel_as_bytes_not_repeated_floats():
    lines = (ROOT / "proto/parallax/ps/v1/ps.proto").read_text().splitlines()
    text = "\n".join(line.split("//")[0] for line in lines)
    assert "repeated float" not in text and "repeated double" not in text
    assert "bytes content = 3;" in text
