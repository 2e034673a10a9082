#!/usr/bin/env bash
# The seed workload on one lent H200, side by side in one run per config (configs/h200-1gpu.yaml,
# BAGEL-7B-shaped AR + DiT on GPU 0): CUDA IPC, Mooncake, the gRPC fallback and the colocated
# baseline (same batching), at max_num_seqs 4 and then 1. Needs .gpu/ (benchmarks/gpu/fetch.sh),
# carried. Results under $OUT. CONFIG picks another config (configs/h200-1gpu-fp8.yaml: the DiT's
# linears in FP8) and TAG is appended to the result names.
set -uo pipefail
source benchmarks/gpu/carried.sh  # $OUT, .gpu/ installed, the shared environment
REQ="${REQ:-32}" RUNS="${RUNS:-3}" CONFIG="${CONFIG:-configs/h200-1gpu.yaml}" TAG="${TAG:-}"
# As in steps.sh: KVRELAY_COMMIT=<hash> names the commit (the copied .git may be stale).
echo "commit ${KVRELAY_COMMIT:-$(git log --oneline -1 2>/dev/null || echo '?') (from the copied .git: may be stale)}" \
  | tee "$OUT/commit.txt"
bench() {  # name, timeout, args...
  local name=$1$TAG limit=$2; shift 2
  echo "\$ python3 -m kvrelay bench --config $CONFIG $*" > "$OUT/$name.md"
  timeout "$limit" python3 -m kvrelay bench --config "$CONFIG" "$@" --output "/tmp/$name" \
    >> "$OUT/$name.md" 2> "/tmp/$name.err"
  echo "rc=$?" >> "$OUT/$name.md"
  tail -c 2500 "/tmp/$name.err" > "$OUT/$name.err.txt"
  cp "/tmp/$name/bench.json" "$OUT/$name.json" 2>/dev/null
  grep -v "^$" "$OUT/$name.md" | cut -c1-260
}
BENCHES="${BENCHES:-b4 b1}"
if [[ " $BENCHES " == *" b4 "* ]]; then
bench bench-seed-b4 "${LIMIT_B4:-360}" --scenario seed --impls "${IMPLS_B4:-cuda_ipc,mooncake,grpc,colocated}" \
  --max-num-seqs 4 --requests "$REQ" --runs "$RUNS" --concurrency 8 --warmup "${WARMUP_B4:-8}"
fi
if [[ " $BENCHES " == *" b1 "* ]]; then
bench bench-seed-b1 "${LIMIT_B1:-200}" --scenario seed --impls "${IMPLS_B1:-cuda_ipc,colocated}" --max-num-seqs 1 \
  --requests "$REQ" --runs "${RUNS_B1:-2}" --concurrency 8 --warmup 2
fi
if [[ " $BENCHES " == *" transfer "* ]]; then
bench bench-transfer "${LIMIT_TR:-150}" --scenario transfer --impls "${IMPLS_TR:-cuda_ipc,mooncake,colocated}" \
  --max-num-seqs 1 --requests "${REQ_TR:-8}" --runs "${RUNS_TR:-2}" --concurrency 4 --warmup 2
fi
