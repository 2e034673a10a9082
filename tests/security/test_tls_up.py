"""`kvrelay up` with TLS end to end: a CA made here, mutual TLS on every channel of the node.

Every process (broker, AR, DiT) serves TLS and dials its peers with its own certificate; the
supervisor's health checks, the SDK, `kvrelay status` and `kvrelay health` use the CA. A
client of the CA generates an image; an operator certificate reads the status, a client one may
not; plaintext and certificate-less callers fail with UNAVAILABLE and say so.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from kvrelay.client import KvRelayClient, KvRelayError, RetryPolicy
from kvrelay.client.cli import run_status
from kvrelay.node.health_probe import run as run_health
from tests.security.certs import TestCa, write_tls_config

REPO = Path(__file__).resolve().parents[2]
NO_RETRY = RetryPolicy(max_attempts=1, initial_backoff=0.01, max_backoff=0.02)

pytestmark = pytest.mark.slow


def _start_up(config: Path, tmp: Path) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "kvrelay", "up", "--config", str(config), "--log-dir", str(tmp / "logs"),
            "--metrics-port", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("KVRELAY_API_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_OPERATOR_TOKEN"):
        env.pop(name, None)
    up = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert up.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("try: kvrelay generate"):
            break
    match = re.search(r"--target (\S+)", "".join(lines))
    if match is None:
        up.kill()
        _, err = up.communicate(timeout=30)
        pytest.fail(f"kvrelay up with TLS did not come up:\n{''.join(lines)}\n{err}")
    return up, match.group(1)


def test_kvrelay_up_with_mutual_tls_generates_an_image(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca = TestCa(tmp_path)
    # One certificate per process, its common name the process's id: mutual TLS binds each
    # replica's id (and the broker's) to its certificate.
    for name in ("broker", "ar-0", "dit-0"):
        ca.issue(name)
    alice = ca.issue("alice")
    operator = ca.issue("kvrelay-operator")
    config = write_tls_config(tmp_path, tmp_path, ca.path)

    up, target = _start_up(config, tmp_path)
    try:
        roots = ca.path.read_bytes()
        chain, key = alice.pem()
        with KvRelayClient(target, root_certificates=roots, certificate_chain=chain, private_key=key) as client:
            result = client.generate("a red fox in the snow", width=64, height=64, seed=3, timeout=120).result()
            image = Image.open(io.BytesIO(result.png))
            assert image.size == (64, 64) and image.format == "PNG"
            # A client certificate is not an operator's.
            with pytest.raises(KvRelayError) as info:
                client.list_replicas()
            assert info.value.code == "PERMISSION_DENIED"

        tls_args = {"tls_ca": str(ca.path), "tls_cert": str(operator.cert), "tls_key": str(operator.key)}
        assert run_status(argparse.Namespace(target=target, json=False, token=None, **tls_args)) == 0
        out = capsys.readouterr().out
        assert "ar-0" in out and "dit-0" in out
        health = argparse.Namespace(target=target, service="", timeout=5.0, **tls_args)
        assert run_health(health) == 0

        # Plaintext to the TLS node: no answer, and the error says UNAVAILABLE (the CLI adds a hint).
        with KvRelayClient(target, retry=NO_RETRY, timeout=5.0) as plain:
            with pytest.raises(KvRelayError) as info:
                plain.list_generations()
            assert info.value.code == "UNAVAILABLE"
        plain_args = argparse.Namespace(target=target, json=False, token=None, tls_ca=None, tls_cert=None,
                                        tls_key=None)  # fmt: skip
        assert run_status(plain_args) == 1
        assert "--tls-ca" in capsys.readouterr().err
        with grpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as raw:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert raw.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        # TLS without a client certificate: the handshake is refused (mutual TLS).
        with KvRelayClient(target, root_certificates=roots, retry=NO_RETRY, timeout=5.0) as anonymous:
            with pytest.raises(KvRelayError) as info:
                anonymous.list_generations()
            assert info.value.code == "UNAVAILABLE"
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.communicate()
    assert up.returncode == 0
