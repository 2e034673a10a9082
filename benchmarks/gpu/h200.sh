#!/usr/bin/env bash
# Everything kvrelay runs on one lent H200, in one call, from source (no registry there):
# carried cp312 wheels (.gpu/whl) and Mooncake's Debian libraries (.gpu/deb), then
#   1. kvrelay up (configs/h200-1gpu.yaml: BAGEL-7B-shaped AR + DiT on GPU 0) + generations
#   2. the GPU-only tests (pinned host mirror, AR on CUDA)
#   3. kvrelay verify (TP=2 producer -> Ulysses SP=2 consumer)
#   4. kvrelay bench, seed workload and transfer-dominated workload
# Results go to $OUT (the device tool brings them back). Prepare .gpu/ with benchmarks/gpu/fetch.sh.
set -uo pipefail
OUT="${OUT:-/tmp/kvrelay-gpu-out}"
mkdir -p "$OUT" /tmp/debroot
for f in .gpu/deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
export LD_LIBRARY_PATH="/tmp/debroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 KVRELAY_LOG_FORMAT=json
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "=== $(date +%T) $*" | tee -a "$OUT/steps.txt"; }
# STEPS picks what runs (default: all), e.g. STEPS="bench" on a short device budget.
STEPS="${STEPS:-up tests verify bench}"
want() { [[ " $STEPS " == *" $1 "* ]]; }

log env
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
} 2>&1 | tee -a "$OUT/steps.txt"

if want up; then
log "1. kvrelay up + generate on GPU"
mkdir -p /tmp/node && (cd /tmp/node && timeout 200 python3 -m kvrelay up --config "$OLDPWD/configs/h200-1gpu.yaml" --log-dir /tmp/node/logs > /tmp/node/up.txt 2>&1 &)
for _ in $(seq 1 150); do grep -q "every process is SERVING" /tmp/node/up.txt 2>/dev/null && break; sleep 1; done
tail -6 /tmp/node/up.txt >> "$OUT/steps.txt"
for i in 1 2 3; do
  timeout 60 python3 -m kvrelay generate "a lighthouse on a cliff at sunset, oil painting $i" --seed $i -q -o "$OUT/h200-$i.png" 2>&1 | tail -2 | tee -a "$OUT/steps.txt"
done
timeout 30 python3 -m kvrelay status 2>&1 | tee -a "$OUT/steps.txt"
pkill -TERM -f "kvrelay up --config" ; sleep 8
tail -c 4000 /tmp/node/logs/*.log > "$OUT/node-logs.txt" 2>/dev/null
fi

if want tests; then
log "2. GPU-only tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/dit_service/test_gpu_mirror.py tests/ar_model/test_ar_gpu.py 2>&1 | tail -5 | tee -a "$OUT/steps.txt"
fi
if want verify; then
log "3. verify"
timeout 90 python3 -m kvrelay verify --ar-tp 2 --dit-sp 2 2>/dev/null | tee -a "$OUT/steps.txt"
fi

if want bench; then
REQ_SEED="${REQ_SEED:-20}" REQ_TRANSFER="${REQ_TRANSFER:-8}"
log "4a. bench: seed workload"
timeout 260 python3 -m kvrelay bench --config configs/h200-1gpu.yaml --requests "$REQ_SEED" --runs 2 --concurrency 8 \
  --scenario seed --warmup 2 --output /tmp/bench-seed > "$OUT/bench-seed.txt" 2> /tmp/bench-seed.err
tail -c 3000 /tmp/bench-seed.err >> "$OUT/bench-seed.txt"; cp /tmp/bench-seed/bench.json "$OUT/bench-seed.json"
log "4b. bench: transfer-dominated workload"
timeout 200 python3 -m kvrelay bench --config configs/h200-1gpu.yaml --requests "$REQ_TRANSFER" --runs 2 --concurrency 4 \
  --scenario transfer --warmup 1 --output /tmp/bench-transfer > "$OUT/bench-transfer.txt" 2> /tmp/bench-transfer.err
tail -c 3000 /tmp/bench-transfer.err >> "$OUT/bench-transfer.txt"; cp /tmp/bench-transfer/bench.json "$OUT/bench-transfer.json"
fi
log done
