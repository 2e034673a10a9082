#!/usr/bin/env bash
# Regenerate kvrelay/v1 (messages, .pyi stubs, gRPC stubs and their typed stubs)
# from protos/kvrelay/v1. The pinned grpcio-tools (pyproject's dev extra)
# emits protobuf 5.x gencode, which runs on protobuf 5.27+ and 6.x.
# On a merge conflict in kvrelay/v1, run this; never merge generated files by hand.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
mkdir -p "$out/kvrelay/v1"
rm -f "$out"/kvrelay/v1/*_pb2*.py "$out"/kvrelay/v1/*_pb2*.pyi
PATH="$(dirname "$py"):$PATH" "$py" -m grpc_tools.protoc -I "$root/protos" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  --mypy_grpc_out="$out" \
  "$root"/protos/kvrelay/v1/*.proto
# grpc stubs import siblings as `from kvrelay.v1 import x_pb2`: absolute, as wanted.
