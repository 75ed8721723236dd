#!/usr/bin/env bash
# Regenerates the committed Python code of the wire contract (tests/server/test_wire_contract.py
# fails when it is stale). Uses the venv's grpcio-tools, pinned to the protobuf 4.25 runtime.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
"${PYTHON:-$root/.venv/bin/python}" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. \
  --grpc_python_out=. proto/parallax/ps/v1/ps.proto
