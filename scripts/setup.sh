#!/usr/bin/env bash
# Set up kvrelay on a fresh Debian/Ubuntu machine: system libraries, a virtualenv in .venv,
# the local CPU build of torch, and kvrelay with its dev extras. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
# Mooncake's transfer engine links libibverbs even for TCP.
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
# docker-compose (the client) validates compose/docker-compose.yml; no engine is needed for that.
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.kvrelay-setup
want="$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages into .venv (torch CPU build, grpc, mooncake, ...)"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v -i '^warning' || true
  # The pinned CPU torch first: an unpinned torch could pull a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v -i 'warning' || true
  .venv/bin/python -m pip install -q -c requirements/constraints.txt -e ".[dev]" 2>&1 | grep -v -i 'warning' || true
  .venv/bin/python -c "import torch, grpc, mooncake.engine, kvrelay.cli" 
  echo "$want" > "$stamp"
fi
echo "setup: ready (.venv/bin/kvrelay)"
