#!/usr/bin/env bash
# The compose deployment, run for real (profile cpu): build the CPU image, `compose up`, wait for
# every healthcheck, `kvrelay generate` from the host against the published port, check the PNG,
# the published metrics and that every DiT page is free again; kill the DiT container's process
# and check the engine restarts it and the next request succeeds; `compose down -v`.
#
# Engines: docker (with `docker compose` or docker-compose) where a Docker daemon answers, else
# podman (docker-compose talking to `podman system service`). Where no image registry is
# reachable, the CPU base is a Debian root filesystem made with debootstrap and `podman import`.
#
# Environment (all optional):
#   KVRELAY_CONTAINER_ENGINE   docker | podman (default: the first that works)
#   KVRELAY_CPU_BASE_IMAGE     base image of the CPU build (default: python:3.11-slim if present or
#                              pullable, else the debootstrap base)
#   KVRELAY_TORCH_INDEX_URL    index for torch in the build (PyTorch's CPU wheel index keeps a
#                              docker build on python:3.11-slim from pulling a CUDA torch)
#   KVRELAY_COMPOSE_CACHE      where the debootstrap root filesystem and the wheelhouse are kept
#                              (default: ~/.cache/kvrelay-compose); reused by later runs
#   KVRELAY_SMOKE_TIMEOUT      seconds to wait for health (default: 600)
# Exit codes: 0 passed, 1 a check failed, 3 no container engine on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

log() { printf 'compose_smoke: %s\n' "$*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
now() { date +%s; }
T0=$(now)

PY=${PYTHON:-python3}
[ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python"
# The host side (generate, status, health) is this checkout's CLI, the client of what is built.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
KVRELAY=("$PY" -m kvrelay)
CACHE=${KVRELAY_COMPOSE_CACHE:-${XDG_CACHE_HOME:-${HOME:-/var/tmp}/.cache}/kvrelay-compose}
mkdir -p "$CACHE"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvrelay-compose-smoke.XXXXXX")
PROJECT="kvrelay-smoke-$$"
COMPOSE_FILE="$ROOT/compose/docker-compose.yml"
IMAGE=localhost/kvrelay:cpu
BG_PIDS=()

# ------------------------------------------------------------------------------ the engine
ENGINE=${KVRELAY_CONTAINER_ENGINE:-}
if [ -z "$ENGINE" ]; then
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then ENGINE=docker
  elif command -v podman >/dev/null 2>&1; then ENGINE=podman
  else log "no container engine: neither a Docker daemon nor podman"; exit 3
  fi
fi
log "engine: $ENGINE"
log "project $PROJECT"

if [ "$ENGINE" = podman ] && [ -z "${CONTAINERS_CONF:-}" ] && [ "$(id -u)" = 0 ] \
    && [ "$(ulimit -Hn)" != unlimited ] && [ "$(ulimit -Hn)" -lt 1048576 ]; then
  # Rootful podman raises RLIMIT_NOFILE to 1048576 in every container, which fails where this
  # process's hard limit is lower ("error setting rlimit type 7"): keep the host's limits.
  printf '[containers]\ndefault_ulimits = []\n' > "$CACHE/containers.conf"
  export CONTAINERS_CONF="$CACHE/containers.conf"
fi

cleanup() {
  local rc=$?
  set +e
  if [ -n "${COMPOSE_CMD:-}" ]; then
    if [ "$rc" -ne 0 ]; then
      log "logs of the failed run:"
      "${COMPOSE[@]}" logs --no-color --tail 40 >&2 2>&1
    fi
    "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || log "compose down -v failed"
  fi
  for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  rm -rf "$WORK"
  log "total_seconds=$(( $(now) - T0 )) exit=$rc"
  exit "$rc"
}
trap cleanup EXIT

# ------------------------------------------------------------------------------ the base image
have_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
DEBOOTSTRAP_BASE=localhost/kvrelay-base:bookworm
# The debootstrap base carries what the Dockerfile would otherwise take from apt.
DEBOOTSTRAP_PACKAGES=python3,python3-venv,ca-certificates,libibverbs1,libnl-3-200,libnl-route-3-200,libnuma1,libcurl4

make_debootstrap_base() {
  command -v debootstrap >/dev/null 2>&1 || fail "no base image reachable and no debootstrap (apt-get install debootstrap)"
  local rootfs="$CACHE/rootfs-bookworm"
  local t=$(now)
  if [ ! -x "$rootfs/usr/bin/python3" ] || [ "$(cat "$CACHE/rootfs.packages" 2>/dev/null)" != "$DEBOOTSTRAP_PACKAGES" ]; then
    log "making a Debian bookworm root filesystem with debootstrap (once; kept in $CACHE)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include="$DEBOOTSTRAP_PACKAGES" bookworm "$rootfs" > "$CACHE/debootstrap.log" 2>&1 \
      || { tail -20 "$CACHE/debootstrap.log" >&2; fail "debootstrap"; }
    chroot "$rootfs" apt-get clean
    echo "$DEBOOTSTRAP_PACKAGES" > "$CACHE/rootfs.packages"
  fi
  tar -C "$rootfs" -c . | "$ENGINE" import - "$DEBOOTSTRAP_BASE" >/dev/null
  log "debootstrap_base_seconds=$(( $(now) - t ))"
}

BASE=${KVRELAY_CPU_BASE_IMAGE:-}
if [ -z "$BASE" ]; then
  if have_image python:3.11-slim; then BASE=python:3.11-slim
  elif have_image docker.io/library/python:3.11-slim; then BASE=docker.io/library/python:3.11-slim
  elif have_image "$DEBOOTSTRAP_BASE" && [ "$(cat "$CACHE/rootfs.packages" 2>/dev/null)" = "$DEBOOTSTRAP_PACKAGES" ]; then
    BASE=$DEBOOTSTRAP_BASE
  elif timeout 120 "$ENGINE" pull -q docker.io/library/python:3.11-slim >/dev/null 2>&1; then
    BASE=docker.io/library/python:3.11-slim
  else
    log "python:3.11-slim cannot be pulled here: using a debootstrap base"
    make_debootstrap_base
    BASE=$DEBOOTSTRAP_BASE
  fi
fi
log "base image: $BASE"

# ------------------------------------------------------------------------------ the CPU image
BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE" --build-arg "TORCH_INDEX_URL=${KVRELAY_TORCH_INDEX_URL:-}")
if [ "$ENGINE" = podman ] && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  # podman mounts a host folder into the build: a wheelhouse filled by the host's pip (which finds
  # the local torch wheel and any index the host is set up for) makes the build itself offline.
  WHEELHOUSE="$CACHE/wheelhouse"
  grep -v '^torch' requirements/constraints.txt > "$WORK/constraints.txt"
  "$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    | grep -v '^torch' > "$WORK/requirements.txt"
  # Refilled only when the dependency list or the pins change (not on every pyproject.toml edit).
  want="$(cat "$WORK/requirements.txt" requirements/constraints.txt | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$WHEELHOUSE/.stamp" 2>/dev/null)" != "$want" ]; then
    t=$(now)
    log "filling the wheelhouse $WHEELHOUSE"
    mkdir -p "$WHEELHOUSE"
    mooncake=$(grep '^mooncake-transfer-engine-non-cuda' requirements/constraints.txt)
    "$PY" -m pip download -q -d "$WHEELHOUSE" -c "$WORK/constraints.txt" "$(grep '^torch==' requirements/constraints.txt)" \
      -r "$WORK/requirements.txt" "$mooncake" "setuptools>=69" wheel 2>&1 | grep -v -i '^warning' >&2 || true
    echo "$want" > "$WHEELHOUSE/.stamp"
    log "wheelhouse_seconds=$(( $(now) - t ))"
  fi
  BUILD_ARGS+=(-v "$WHEELHOUSE:/wheelhouse:ro" --build-arg WHEELHOUSE=/wheelhouse)
fi
t=$(now)
log "building $IMAGE (layer cache: the dependency layer rebuilds only when the dependency list or the pins change)"
previous=$("$ENGINE" image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
"$ENGINE" build -q -f compose/Dockerfile -t "$IMAGE" "${BUILD_ARGS[@]}" . > "$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log" >&2; fail "image build"; }
log "build_seconds=$(( $(now) - t ))"
# The image this build replaced (1.5 GB) goes, unless something still uses it, and so do untagged
# images of earlier kvrelay builds (the Dockerfile labels its stages; nothing else is touched).
current=$("$ENGINE" image inspect -f '{{.Id}}' "$IMAGE")
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then "$ENGINE" rmi "$previous" >/dev/null 2>&1 || true; fi
"$ENGINE" image prune -f --filter label=org.kvrelay.build=compose >/dev/null 2>&1 || true

# ------------------------------------------------------------------------------ compose
if [ "$ENGINE" = docker ] && docker compose version >/dev/null 2>&1; then
  COMPOSE_CMD=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE_CMD=(docker-compose)
else
  fail "no compose: install the compose plugin or docker-compose"
fi
if [ "$ENGINE" = podman ]; then
  # docker-compose speaks the Docker API; podman serves it on a socket of our own.
  SOCK="$WORK/podman.sock"
  podman system service --time=0 "unix://$SOCK" > "$WORK/podman-service.log" 2>&1 &
  BG_PIDS+=($!)
  for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
  [ -S "$SOCK" ] || fail "podman system service did not start"
  export DOCKER_HOST="unix://$SOCK"
fi

# Tokens: fresh random ones for this run, in an env file of its own (never a default secret).
ENV_FILE="$WORK/kvrelay.env"
"$PY" - > "$ENV_FILE" <<'EOF'
import secrets

from kvrelay.security import replica_token_for

for name in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN"):
    print(f"{name}={secrets.token_hex(32)}")
# Bound replica tokens: the broker's secret, and each replica's own token derived from it.
secret = secrets.token_hex(32)
print(f"KVRELAY_REPLICA_SECRET={secret}")
print(f"KVRELAY_AR0_TOKEN={replica_token_for(secret, 'ar-0')}")
print(f"KVRELAY_DIT0_TOKEN={replica_token_for(secret, 'dit-0')}")
EOF
chmod 600 "$ENV_FILE"
# Free host ports for what is published, so the run never collides with a `kvrelay up` on the
# default ports.
read -r BROKER_PORT BROKER_METRICS AR_METRICS DIT_METRICS < <("$PY" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
cat >> "$ENV_FILE" <<EOF
KVRELAY_CPU_BASE_IMAGE=$BASE
KVRELAY_BROKER_PORT=$BROKER_PORT
KVRELAY_BROKER_METRICS_PORT=$BROKER_METRICS
KVRELAY_AR_METRICS_PORT=$AR_METRICS
KVRELAY_DIT_METRICS_PORT=$DIT_METRICS
KVRELAY_THREADS_PER_RANK=${KVRELAY_THREADS_PER_RANK:-1}
EOF
COMPOSE=("${COMPOSE_CMD[@]}" -p "$PROJECT" -f "$COMPOSE_FILE" --env-file "$ENV_FILE" --profile cpu)
set -a; . "$ENV_FILE"; set +a

if [ "$ENGINE" = podman ] && [ ! -d /run/systemd/system ]; then
  # podman schedules healthchecks with systemd timers; without systemd nothing runs them, so this
  # loop does what the timers would (`podman healthcheck run` on every container of the project,
  # every interval). With systemd, or with docker, the engine runs them itself.
  (
    while sleep 5; do
      for c in $(podman ps -q --filter "label=com.docker.compose.project=$PROJECT"); do
        podman healthcheck run "$c" >/dev/null 2>&1 || true
      done
    done
  ) &
  BG_PIDS+=($!)
  log "no systemd: running the healthchecks from this script every 5 s"
fi

t=$(now)
"${COMPOSE[@]}" up -d --no-build > "$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; fail "compose up"; }
declare -A CID
for svc in broker-cpu ar-cpu dit-cpu; do CID[$svc]=$("${COMPOSE[@]}" ps -q "$svc"); done
cid() { echo "${CID[$1]}"; }
wait_healthy() {  # every service healthy within KVRELAY_SMOKE_TIMEOUT
  local deadline=$(( $(now) + ${KVRELAY_SMOKE_TIMEOUT:-600} )) svc status all
  while :; do
    all=1
    for svc in broker-cpu ar-cpu dit-cpu; do
      status=$("$ENGINE" inspect -f '{{.State.Health.Status}}' "$(cid "$svc")" 2>/dev/null || echo missing)
      [ "$status" = healthy ] || all=0
    done
    [ "$all" = 1 ] && return 0
    [ "$(now)" -lt "$deadline" ] || { "${COMPOSE[@]}" ps >&2; fail "services not healthy in time"; }
    sleep 2
  done
}
wait_healthy
log "healthy_seconds=$(( $(now) - t ))"
TARGET="127.0.0.1:$BROKER_PORT"
"${KVRELAY[@]}" health --target "$TARGET" >/dev/null || fail "the published broker port does not answer SERVING"

# ------------------------------------------------------------------------------ checks
generate_and_check() {  # $1: name of the PNG
  local png="$WORK/$1.png" t
  t=$(now)
  "${KVRELAY[@]}" generate "a red fox in the snow, watercolor" --seed 7 --steps 2 --width 256 --height 256 \
    --target "$TARGET" --token "$KVRELAY_API_TOKEN" --timeout 300 -q -o "$png" >&2 \
    || fail "kvrelay generate ($1)"
  log "generate_seconds[$1]=$(( $(now) - t ))"
  "$PY" - "$png" <<'EOF' || fail "the PNG ($1)"
import sys
from PIL import Image
path = sys.argv[1]
with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
image = Image.open(path)
image.load()
assert image.size == (256, 256), image.size
low, high = image.convert("L").getextrema()
assert high > low, "a blank image"
EOF
  # Every page back in the pool once the result is out (the release may trail the result briefly).
  "$PY" - "$TARGET" <<'EOF' || fail "pages not all free after $1"
import json, subprocess, sys, time
target = sys.argv[1]
deadline = time.monotonic() + 30
while True:
    out = subprocess.run([sys.executable, "-m", "kvrelay", "status", "--json", "--target", target], check=True,
                         capture_output=True, text=True).stdout
    doc = json.loads(out)
    live = [p for p in doc["pools"] if not p.get("fenced")]
    ok = bool(live) and all(p["free_pages"] == p["total_pages"] > 0 for p in live) and not doc["tickets"]
    if ok:
        print(f"pages free: {[(p['replica_id'], p['free_pages']) for p in live]}", file=sys.stderr)
        break
    if time.monotonic() > deadline:
        sys.exit(f"pools {doc['pools']} tickets {doc['tickets']}")
    time.sleep(1)
EOF
}

generate_and_check first

# The tokens from the env file are what guards the published API: without them the broker refuses.
env -u KVRELAY_API_TOKEN -u KVRELAY_OPERATOR_TOKEN -u KVRELAY_REPLICA_TOKEN "${KVRELAY[@]}" generate "no token" \
  --steps 1 --width 64 --height 64 --target "$TARGET" --timeout 60 -q -o "$WORK/refused.png" 2> "$WORK/refused.log" \
  && fail "a generation without the API token was served"
grep -q UNAUTHENTICATED "$WORK/refused.log" || { cat "$WORK/refused.log" >&2; fail "no UNAUTHENTICATED without a token"; }
env -u KVRELAY_API_TOKEN -u KVRELAY_OPERATOR_TOKEN -u KVRELAY_REPLICA_TOKEN "${KVRELAY[@]}" status --target "$TARGET" \
  > /dev/null 2>&1 && fail "kvrelay status without the operator token was answered"
log "tokens enforced: no token is UNAUTHENTICATED for generate and status"
# Bound replica tokens, as the compose configs say: the replicas hold their own token and never the
# secret, and ar-0's token does not open the broker's replica RPCs as dit-0.
for svc in ar-cpu dit-cpu; do
  "${COMPOSE[@]}" exec -T "$svc" sh -c 'test -n "${KVRELAY_REPLICA_TOKEN:-}" && test -z "${KVRELAY_REPLICA_SECRET:-}"' \
    || fail "$svc: not its own replica token alone (or it holds the replica secret)"
done
"$PY" - "$TARGET" <<'EOF' || fail "ar-0's token acted as dit-0"
import os, sys
import grpc
from kvrelay.errors import reason_of
from kvrelay.security import ChannelSecurity, make_sync_channel
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
with make_sync_channel(sys.argv[1], ChannelSecurity(token=os.environ["KVRELAY_AR0_TOKEN"], replica_id="dit-0")) as ch:
    try:
        broker_pb2_grpc.BrokerServiceStub(ch).Heartbeat(
            broker_pb2.HeartbeatRequest(replica_id="dit-0", incarnation_id="smoke-impostor"), timeout=10)
    except grpc.RpcError as err:
        code, reason, message = reason_of(err)
        assert (code, reason) == ("UNAUTHENTICATED", "REPLICA_TOKEN_MISMATCH"), (code, reason, message)
    else:
        sys.exit("a heartbeat as dit-0 with ar-0's token was answered")
EOF
log "replica tokens bound: ar-0's token as dit-0 is REPLICA_TOKEN_MISMATCH; the replicas hold no secret"

# Published metrics: one scrape of each process from the host.
"$PY" - "$BROKER_METRICS" "$AR_METRICS" "$DIT_METRICS" <<'EOF' || fail "published metrics"
import sys, urllib.request
broker, ar, dit = sys.argv[1:]
def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()
text = scrape(broker)
done = [l for l in text.splitlines() if l.startswith("kvrelay_generations_total") and 'outcome="succeeded"' in l]
assert done and float(done[0].split()[-1]) >= 1, "broker: no succeeded generation counted"
for name, port in (("ar", ar), ("dit", dit)):
    assert "kvrelay_" in scrape(port), f"{name}: no kvrelay metrics on {port}"
EOF
log "metrics published: broker :$BROKER_METRICS, ar :$AR_METRICS, dit :$DIT_METRICS"
"${COMPOSE[@]}" exec -T broker-cpu test -s /opt/kvrelay/.kvrelay/broker.sqlite \
  || fail "no journal in the named volume"

# Crash the DiT (SIGKILL to its main process from the host, as the OOM killer would; `kill`
# through the engine counts as a manual stop and is never restarted) and expect a restart.
DIT=$(cid dit-cpu)
restarts=$("$ENGINE" inspect -f '{{.RestartCount}}' "$DIT")
pid=$("$ENGINE" inspect -f '{{.State.Pid}}' "$DIT")
[ "$pid" -gt 0 ] || fail "the DiT container has no process"
kill -9 "$pid" 2>/dev/null || sudo -n kill -9 "$pid" || fail "cannot kill pid $pid"
log "killed the DiT (pid $pid)"
t=$(now)
deadline=$(( $(now) + 120 ))
until [ "$("$ENGINE" inspect -f '{{.RestartCount}}' "$DIT")" -gt "$restarts" ]; do
  [ "$(now)" -lt "$deadline" ] || fail "the DiT container was not restarted"
  sleep 1
done
wait_healthy
log "dit_restart_seconds=$(( $(now) - t ))"
generate_and_check after-restart

log "PASSED (engine $ENGINE, base $BASE)"
