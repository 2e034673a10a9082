#!/usr/bin/env bash
# What has never run on a GPU, in one call on a lent H200 (.gpu/ from benchmarks/gpu/fetch.sh,
# carried): every test marked `gpu`, the checksum kernel vs the eager torch ops
# (benchmarks/gpu/checksum.py), `kvrelay verify --device cuda`, then the transfer-dominated
# workload with each device checksum in CHECKSUM_MODES (default "eager triton"), one after the
# other, and the seed workload (bf16, max_num_seqs 1; CONFIG picks another config). STEPS picks
# parts ("tests checksum verify transfer seed"; default all but seed).
# KVRELAY_COMMIT=<hash> names the commit (the copied .git may be stale). Results under $OUT.
set -uo pipefail
source benchmarks/gpu/carried.sh  # $OUT, .gpu/ installed, the shared environment
STEPS="${STEPS:-tests checksum verify transfer}" CONFIG="${CONFIG:-configs/h200-1gpu.yaml}"
want() { [[ " $STEPS " == *" $1 "* ]]; }
{ echo "commit ${KVRELAY_COMMIT:-$(git log --oneline -1 2>/dev/null || echo '?') (from the copied .git: may be stale)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if want tests; then
  rm -rf /tmp/gpu-pytest
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider --basetemp /tmp/gpu-pytest -m gpu ${GPU_TESTS:-tests/ar_model tests/bagel \
    tests/dit_model tests/dit_service/test_gpu_mirror.py tests/e2e/test_demo_prompts.py tests/transfer/test_cuda_ipc.py} \
    > "$OUT/gpu-tests.txt" 2>&1
  grep -E "^(FAILED|ERROR|E  )|passed|failed" "$OUT/gpu-tests.txt" | cut -c1-300 | tail -25
  # The processes' own logs (a node test's broker, AR and DiT), the last 200 KB of each.
  mkdir -p "$OUT/gpu-test-logs"
  find /tmp/gpu-pytest -name "*.log" -size +0 2>/dev/null | while read -r f; do
    tail -c 200000 "$f" > "$OUT/gpu-test-logs/$(echo "${f#/tmp/gpu-pytest/}" | tr '/' '_')"; done
fi
if want checksum; then
  timeout 60 python3 benchmarks/gpu/checksum.py 2>&1 | tail -8 | tee "$OUT/checksum.txt"
fi
if want verify; then
  echo "\$ python3 -m kvrelay verify --device cuda" > "$OUT/verify-cuda.txt"
  timeout "${VERIFY_TIMEOUT:-150}" python3 -m kvrelay verify --device cuda >> "$OUT/verify-cuda.txt" 2> /tmp/verify-cuda.err
  echo "verify rc=$?" >> "$OUT/verify-cuda.txt"; tail -c 1500 /tmp/verify-cuda.err >> "$OUT/verify-cuda.txt"
  grep -v "^\s*$" "$OUT/verify-cuda.txt" | tail -12
fi
if want transfer; then
  for mode in ${CHECKSUM_MODES:-eager triton}; do
    echo "\$ KVRELAY_DEVICE_CHECKSUM=$mode python3 -m kvrelay bench --config $CONFIG --scenario transfer" \
      "--impls ${IMPLS_TR:-cuda_ipc,colocated} --max-num-seqs 1 --requests ${REQ_TR:-100} --runs ${RUNS_TR:-3} --concurrency 4 --warmup 2" \
      > "$OUT/transfer-$mode.md"
    KVRELAY_DEVICE_CHECKSUM=$mode timeout "${LIMIT_TR:-200}" python3 -m kvrelay bench --config "$CONFIG" \
      --scenario transfer --impls "${IMPLS_TR:-cuda_ipc,colocated}" --max-num-seqs 1 --requests "${REQ_TR:-100}" \
      --runs "${RUNS_TR:-3}" --concurrency 4 --warmup 2 --output "/tmp/tr-$mode" >> "$OUT/transfer-$mode.md" 2> "/tmp/tr-$mode.err"
    echo "rc=$?" >> "$OUT/transfer-$mode.md"; tail -c 1500 "/tmp/tr-$mode.err" >> "$OUT/transfer-$mode.md"
    grep -E "^\||rc=" "$OUT/transfer-$mode.md" | cut -c1-200
  done
fi
if want seed; then
  args=(--scenario seed --impls "${IMPLS_SEED:-cuda_ipc,colocated}" --max-num-seqs 1 --requests "${REQ_SEED:-100}"
        --runs "${RUNS_SEED:-3}" --concurrency 8 --warmup 2)
  echo "\$ python3 -m kvrelay bench --config $CONFIG ${args[*]}" > "$OUT/seed.md"
  timeout "${LIMIT_SEED:-240}" python3 -m kvrelay bench --config "$CONFIG" "${args[@]}" --output /tmp/seed \
    >> "$OUT/seed.md" 2> /tmp/seed.err
  echo "rc=$?" >> "$OUT/seed.md"; tail -c 1500 /tmp/seed.err >> "$OUT/seed.md"
  grep -E "^\||rc=" "$OUT/seed.md" | cut -c1-200
fi
