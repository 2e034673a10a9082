#!/usr/bin/env bash
# The main job on a fresh machine: set up, start a node (`kvrelay up` with configs/single-node.yaml:
# broker + 1 AR + 1 DiT on CPU, KV over Mooncake TCP), generate one image, stop the node.
# Usage: scripts/quickstart.sh ["prompt"] [output.png]   (KVRELAY_CONFIG=... picks another config)
set -euo pipefail
prompt="${1:-a red circle on a blue background, top left}"
out="${2:-out.png}"
# A relative output path is the caller's, not the repository's (resolved before the cd below).
[[ "$out" = /* ]] || out="$PWD/$out"
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
config="${KVRELAY_CONFIG:-configs/single-node.yaml}"
mkdir -p .kvrelay/logs

kvrelay up --config "$config" --log-dir .kvrelay/logs &
up_pid=$!
stop_node() {
  [ -n "$up_pid" ] || return 0
  kill -TERM "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; up_pid=""
}
trap stop_node EXIT
trap "exit 130" INT
trap "exit 143" TERM

target="$(python - "$config" <<'PY'
import sys
from kvrelay.config import load_config
b = load_config(sys.argv[1]).broker
print(f"{b.host}:{b.port}")
PY
)"
echo "quickstart: waiting for the node at $target (models load, memory registers) ..."
for _ in $(seq 1 300); do
  if ! kill -0 "$up_pid" 2>/dev/null; then
    echo "quickstart: kvrelay up exited before the node served (why: its lines above; each process's log: .kvrelay/logs)" >&2
    exit 1
  fi
  # Ready = an AR and a DiT replica registered, up and not fenced (they register once SERVING).
  if kvrelay status --target "$target" --json 2>/dev/null | python -c '
import json, sys
roles = {r["role"] for r in json.load(sys.stdin)["replicas"] if r["up"] and not r["fenced"]}
sys.exit(0 if {"AR", "DIT"} <= roles else 1)' 2>/dev/null; then break; fi
  sleep 1
done
kvrelay status --target "$target"
kvrelay generate "$prompt" --target "$target" -o "$out" --steps 8 --guidance-scale 3.0
kvrelay status --target "$target"
# The node stops before the last line, so that line (where the image is) ends the output instead
# of the node's stop lines.
stop_node
echo "quickstart: wrote $out; the node is stopped (logs: .kvrelay/logs); to keep one serving: kvrelay up (README.md, Using it)"
