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
(cd .gpu/deb && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200)
du -sh .gpu
