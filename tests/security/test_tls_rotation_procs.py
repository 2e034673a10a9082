"""`kvrelay rotate-secrets` reloads the broker's TLS certificate and key (kvrelay/server_tls.py;
docs/operations.md, Rotating the replica secret), against a real `kvrelay broker` serving TLS from
files, with certificates of a throwaway CA (tests/security/certs.py): after the files hold a new
pair and the rotation, every new connection gets the new certificate while a channel opened
before keeps working; a pair that a client trusting the CA would refuse (the key of another
certificate, a certificate of another CA) is refused whole (exit 1 with why), the old pair kept,
and a token file changed with it is not taken either (all or nothing)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.node.cli import main
from kvrelay.security import SecurityError, TlsMaterial
from kvrelay.server_tls import check_server_pair
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
from tests.broker.test_forget_replica import _md
from tests.procs import start_service
from tests.security.certs import TestCa, install_pair, presented, tls_security

OPERATOR, OPERATOR_NEW = "tls-rotation-operator-old", "tls-rotation-operator-new"
REPLICA = "tls-rotation-replica-token"
pytestmark = pytest.mark.usefixtures("no_ambient_tokens")


def _write(path: Path, text: str) -> None:
    path.with_suffix(".tmp").write_text(text + "\n")
    os.replace(path.with_suffix(".tmp"), path)


def _rotate(capsys: pytest.CaptureFixture[str], address: str, ca: Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["rotate-secrets", "--target", address, "--token", OPERATOR, "--tls-ca", str(ca)])
    out, err = capsys.readouterr()
    return code, out, err


def _operator_code(stub: broker_pb2_grpc.BrokerServiceStub, token: str) -> grpc.StatusCode:
    try:
        stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=10, metadata=_md(token))
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_rotate_secrets_serves_a_new_certificate_to_new_connections_and_refuses_a_bad_pair(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for sub in ("ca", "a", "b", "other", "live"):
        (tmp_path / sub).mkdir()
    ca = TestCa(tmp_path / "ca")
    ca.folder = tmp_path / "a"
    first = ca.issue("broker")
    ca.folder = tmp_path / "b"
    second = ca.issue("broker")
    foreign = TestCa(tmp_path / "other", name="another CA").issue("broker")
    live = tmp_path / "live"
    install_pair(live, "broker", first.cert, first.key)
    _write(tmp_path / "operator.token", OPERATOR)
    _write(tmp_path / "broker.token", REPLICA)
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"].update(journal_path=str(tmp_path / "broker.sqlite"))
    cfg["security"] = {
        "replica_token_file": str(tmp_path / "{name}.token"),
        "operator_token_file": str(tmp_path / "operator.token"),
        **tls_security(live, ca.path, require_client_cert=False),
    }
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(cfg))
    broker = start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"], cwd=repo_root)
    try:
        address = broker.address
        assert presented(address, ca.path) == first.der()
        options = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.path.read_bytes()), options) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            assert _operator_code(stub, OPERATOR) == grpc.StatusCode.OK  # connected, on the first certificate

            code, out, err = _rotate(capsys, address, ca.path)
            assert code == 0 and "tls: unchanged (security.tls.cert_file (" in out and "nothing changed" in out, out + err

            install_pair(live, "broker", second.cert, second.key)
            code, out, err = _rotate(capsys, address, ca.path)
            assert code == 0 and "tls: reloaded" in out and "new credentials taken" in out, out + err
            assert presented(address, ca.path) == second.der()  # a new connection: the new certificate
            assert _operator_code(stub, OPERATOR) == grpc.StatusCode.OK  # the one up before goes on

            # Refused whole, the pair served kept: the key of another certificate, then another
            # CA's certificate; an operator token changed beside it is not taken either.
            _write(tmp_path / "operator.token", OPERATOR_NEW)
            for cert, key, why in ((first.cert, second.key, "the key is not the certificate's"),
                                   (foreign.cert, foreign.key, "a client trusting security.tls.ca_file refuses")):  # fmt: skip
                install_pair(live, "broker", cert, key)
                code, out, err = _rotate(capsys, address, ca.path)
                assert code == 1 and why in err and "nothing taken" in err, out + err
                assert "tls: failed" in out and "operator_token: failed" in out, out
                assert presented(address, ca.path) == second.der()
                assert _operator_code(stub, OPERATOR_NEW) == grpc.StatusCode.UNAUTHENTICATED
            assert _operator_code(stub, OPERATOR) == grpc.StatusCode.OK
    finally:
        assert broker.stop() == 0, broker.output()


def test_check_server_pair_says_why_a_pair_is_refused(tmp_path: Path) -> None:
    ca = TestCa(tmp_path)
    leaf = ca.issue("broker")
    cert, key = leaf.pem()
    roots = ca.path.read_bytes()
    check_server_pair(TlsMaterial(cert, key, roots), "w")  # a good pair passes
    (tmp_path / "other").mkdir()
    other = TestCa(tmp_path / "other", name="another CA")
    cases = [
        (TlsMaterial(cert, b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", roots),
         "not a certificate chain and its private key"),
        (TlsMaterial(cert, key, other.path.read_bytes()), "refuses this certificate"),
        (TlsMaterial(cert, key, b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"),
         "security.tls.ca_file holds no CA certificate"),
    ]  # fmt: skip
    for tls, why in cases:
        with pytest.raises(SecurityError, match=why):
            check_server_pair(tls, "w")
