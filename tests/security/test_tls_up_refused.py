"""`kvrelay up` refuses, in one line and before starting anything, a TLS pair of one of its
processes that its peers would refuse (found black-box: a DiT with an expired certificate)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvrelay.node.cli import main
from tests.security.certs import TestCa, _name, _write_key

REPO = Path(__file__).resolve().parents[2]


def _expired(ca: TestCa, common_name: str) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=3)).not_valid_after(now - dt.timedelta(days=1))
        .sign(ca.key, hashes.SHA256())
    )  # fmt: skip
    (ca.folder / f"{common_name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, ca.folder / f"{common_name}.key")


def test_kvrelay_up_refuses_a_process_certificate_its_peers_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = TestCa(tmp_path)
    for name in ("broker", "ar-0", "ar-1", "dit-0"):
        ca.issue(name)
    _expired(ca, "dit-1")
    data = yaml.safe_load((REPO / "tests" / "configs" / "test-fast.yaml").read_text())
    data["broker"]["journal_path"] = str(tmp_path / "journal.sqlite")
    for stage in data["stages"]:
        stage["num_replicas"] = 2
    data["security"] = {
        "tls": {"cert_file": str(tmp_path / "{name}.pem"), "key_file": str(tmp_path / "{name}.key"),
                "ca_file": str(ca.path), "require_client_cert": True},
    }  # fmt: skip
    config = tmp_path / "tls.yaml"
    config.write_text(yaml.safe_dump(data))
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
    _expired(ca, f"{role}-0")
    data = yaml.safe_load((REPO / "tests" / "configs" / "test-fast.yaml").read_text())
    data["security"] = {
        "tls": {"cert_file": str(tmp_path / "{name}.pem"), "key_file": str(tmp_path / "{name}.key"),
                "ca_file": str(ca.path), "require_client_cert": True},
    }  # fmt: skip
    config = tmp_path / "tls.yaml"
    config.write_text(yaml.safe_dump(data))
    # Before: the replica started, never registered (the broker refused its handshake) and logged
    # only `broker_not_reachable_yet ... DEADLINE_EXCEEDED` until its wait for the broker gave up.
    proc = subprocess.run(
        [sys.executable, "-m", "kvrelay", role, "--config", str(config), "--replica", "0"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"kvrelay {role}: {role}-0: security.tls.cert_file ({tmp_path}/{role}-0.pem)" in proc.stderr
            and "refuses this certificate (certificate has expired)" in proc.stderr), proc.stderr[-2000:]  # fmt: skip
