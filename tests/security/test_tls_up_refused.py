"""`kvrelay up` refuses, in one line and before starting anything, a TLS pair of one of its
processes that its peers would refuse (found black-box: a DiT with an expired certificate)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.node.cli import main
from tests.security.certs import TestCa, write_tls_config

REPO = Path(__file__).resolve().parents[2]


def test_kvrelay_up_refuses_a_process_certificate_its_peers_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = TestCa(tmp_path)
    for name in ("broker", "ar-0", "ar-1", "dit-0"):
        ca.issue(name)
    ca.issue("dit-1", expired=True)
    config = write_tls_config(tmp_path, tmp_path, ca.path, num_replicas=2)
    # Before: dit-1 started, never registered (the broker refused its handshake) and logged no
    # warning; kvrelay up waited for its ready timeout printing gRPC's handshake errors.
    assert main(["up", "--config", str(config), "--log-dir", str(tmp_path / "logs"), "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvrelay up: dit-1: security.tls.cert_file ({tmp_path}/dit-1.pem), security.tls.key_file "
        f"({tmp_path}/dit-1.key), security.tls.ca_file ({ca.path}): a client trusting security.tls.ca_file "
        "refuses this certificate (certificate has expired)\n"
    )
    # A key that is not the certificate's is refused the same way.
    ca.issue("dit-1")
    (tmp_path / "ar-1.key").write_bytes((tmp_path / "ar-0.key").read_bytes())
    assert main(["up", "--config", str(config), "--log-dir", str(tmp_path / "logs"), "--metrics-port", "0"]) == 2
    assert capsys.readouterr().err.startswith("kvrelay up: ar-1: security.tls.cert_file")


@pytest.mark.parametrize("role", ["ar", "dit"])
def test_a_replica_refuses_to_start_with_a_certificate_its_peers_would_refuse(role: str, tmp_path: Path) -> None:
    ca = TestCa(tmp_path)
    ca.issue(f"{role}-0", expired=True)
    config = write_tls_config(tmp_path, tmp_path, ca.path)
    # Before: the replica started, never registered (the broker refused its handshake) and logged
    # only `broker_not_reachable_yet ... DEADLINE_EXCEEDED` until its wait for the broker gave up.
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay", role, "--config", str(config), "--replica", "0"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"kvrelay {role}: {role}-0: security.tls.cert_file ({tmp_path}/{role}-0.pem)" in proc.stderr
            and "refuses this certificate (certificate has expired)" in proc.stderr), proc.stderr[-2000:]  # fmt: skip
