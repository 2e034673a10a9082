# Sourced by the scripts in benchmarks/gpu/ that run on a lent GPU machine: $OUT, the carried
# Debian libraries and cp312 wheels of .gpu/ (benchmarks/gpu/fetch.sh), and the environment they share.
OUT="${OUT:-/tmp/kvrelay-gpu-out}"
mkdir -p "$OUT" /tmp/debroot
for f in .gpu/deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
export LD_LIBRARY_PATH="/tmp/debroot/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 KVRELAY_LOG_FORMAT=json
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
