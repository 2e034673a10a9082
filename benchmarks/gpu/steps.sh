#!/usr/bin/env bash
# Model steps and the CUDA IPC path on one lent H200, in one call: the GPU tests (captured steps
# == eager bit for bit, a two-process CUDA IPC write verified on the device), `kvrelay verify
# --device cuda` (needs the wheels of benchmarks/gpu/fetch.sh in .gpu/, carried), then
# benchmarks/gpu/profile_steps.py (step times eager vs graph, FLOP floors, kernel tables).
# Results under $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/kvrelay-gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .gpu/whl ]; then  # carried wheels (benchmarks/gpu/fetch.sh): Mooncake and gRPC for verify
  mkdir -p /tmp/debroot && for f in .gpu/deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
  export LD_LIBRARY_PATH="/tmp/debroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD"
fi
nvidia-smi --query-gpu=name,memory.used,driver_version --format=csv,noheader | tee "$OUT/env.txt"
# The GPU machine's copy of the tree may carry a stale .git: pass KVRELAY_COMMIT=<hash> from the
# checkout that was copied (git rev-parse --short HEAD there) to record the right commit.
echo "commit ${KVRELAY_COMMIT:-$(git log --oneline -1 2>/dev/null || echo '?') (from the copied .git: may be stale)}" \
  | tee -a "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -s ${GPU_TESTS:-tests/dit_model/test_cuda_graphs.py tests/dit_model/test_fp8.py \
  tests/ar_model/test_ar_gpu.py tests/transfer/test_cuda_ipc.py} 2>&1 | grep -v "^$" | tail -30 | tee "$OUT/gpu-tests.txt"
timeout "${PROFILE_TIMEOUT:-220}" python3 benchmarks/gpu/profile_steps.py --out "$OUT" --reps 10 ${PROFILE_ARGS:-} \
  > "$OUT/profile-stdout.txt" 2>&1
grep -E "TFLOP|prefill_batch|DiT step|decode|compile|Error|error" "$OUT/profile-stdout.txt" | cut -c1-400
echo "\$ python3 -m kvrelay verify --device cuda" > "$OUT/verify-cuda.txt"
timeout "${VERIFY_TIMEOUT:-120}" python3 -m kvrelay verify --device cuda >> "$OUT/verify-cuda.txt" 2> "$OUT/verify-cuda.err"
echo "verify rc=$?" >> "$OUT/verify-cuda.txt"; cat "$OUT/verify-cuda.txt"; tail -5 "$OUT/verify-cuda.err"
