#!/usr/bin/env bash
# Model steps on one lent H200, in one call (needs only the GPU image's torch): the GPU tests of
# the captured steps (graph == eager bit for bit), then benchmarks/gpu/profile_steps.py (step
# times eager vs graph, FLOP floors, kernel tables). Results under $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/kvrelay-gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,driver_version --format=csv,noheader | tee "$OUT/env.txt"
git log --oneline -1 | tee -a "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -x tests/dit_model/test_cuda_graphs.py \
  tests/ar_model/test_ar_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
timeout "${PROFILE_TIMEOUT:-300}" python3 benchmarks/gpu/profile_steps.py --out "$OUT" --reps 10 ${PROFILE_ARGS:-} \
  > "$OUT/profile-stdout.txt" 2>&1
grep -E "TFLOP|prefill_batch|DiT step|decode|compile|Error|error" "$OUT/profile-stdout.txt" | cut -c1-400
