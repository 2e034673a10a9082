#!/usr/bin/env bash
# Prepare .gpu/ (ignored by git) for benchmarks/gpu/h200.sh: cp312 wheels the GPU image lacks and
# the Debian libraries Mooncake links. Run here, where the registries are reachable.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu/whl .gpu/deb
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .gpu/whl mooncake-transfer-engine-non-cuda==0.3.13.post1 grpcio==1.66.2 protobuf==5.29.6 \
  grpcio-health-checking==1.66.2 grpcio-reflection==1.66.2 grpcio-status==1.66.2 googleapis-common-protos==1.75.0 \
  structlog pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
# diffusers for the demo / BAGEL DiT (its scheduler and the FLUX VAE) and what it imports, less
# numpy, filelock, fsspec, typing-extensions and huggingface-hub: the image has them (torch; its
# transformers needs huggingface-hub < 2, which a carried 2.x shadowed), and carried.sh's
# --target install would shadow torch's own.
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .gpu/whl diffusers==0.42.1 importlib-metadata==10.2.0 zipp==4.1.2 regex==2026.12.2 \
  safetensors==0.8.0 pillow==13.0.0 requests==2.34.2 urllib3==2.8.0 idna==3.21 certifi==2026.10.19.post1 \
  charset-normalizer==3.5.3 hf-xet==1.8.0 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 anyio==4.16.0 \
  click==8.5.1 tqdm==4.70.1 pyyaml==6.0.4 packaging==26.4 lazy-importer==0.1.0 truststore==0.10.5
# The Mooncake wheel without the executables kvrelay never runs (transfer_engine_bench alone is
# 42 MB, the master's own copy of libetcd_wrapper 10 MB): the tracked tree plus .gpu/ must stay
# under the device tool's 64 MiB (about 10 + 49 MiB).
.venv/bin/python benchmarks/gpu/slim_wheel.py .gpu/whl/mooncake_transfer_engine_non_cuda-*.whl \
  mooncake/transfer_engine_bench mooncake/mooncake_master mooncake/mooncake_client \
  mooncake_transfer_engine_non_cuda.libs/libetcd_wrapper-0b032a94.so
(cd .gpu/deb && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200)
du -sh .gpu
