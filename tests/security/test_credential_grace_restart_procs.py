"""A broker killed (SIGKILL) during a credential rotation's grace still honours it once restarted
(broker/credential_grace.py; docs/operations.md, Rotating the replica secret): a real `kvrelay
broker` (bound replica tokens, the secret in a file) rotated with `kvrelay rotate-secrets`,
killed with kill -9 right after, started again on the same journal: a replica presenting its
token of the replaced secret still registers until the grace ends and is refused after it, and
the journal (with its WAL) holds neither secret nor any token in plaintext."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.node.cli import main
from kvrelay.security import replica_token_for
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_forget_replica import _md, _register
from tests.broker.test_grpc import replica
from tests.procs import ServiceProcess, start_service

OLD, NEW = "grace-procs-secret-old-0123456789", "grace-procs-secret-new-9876543210"
OPERATOR = "grace-procs-operator-token"
# Long enough for the kill and the restart (a broker start: about 1 s, a few on a loaded 2-core
# machine) to fit well inside it; every second of it is waited out once (it was 30 s).
GRACE_S = 12.0


@pytest.fixture(autouse=True)
def _no_ambient_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_REPLICA_SECRET"):
        monkeypatch.delenv(env, raising=False)


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _start(repo_root: Path, config: Path) -> ServiceProcess:
    return start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"], cwd=repo_root)


def _grace_left(stub: broker_pb2_grpc.BrokerServiceStub) -> float:
    reply = stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=10, metadata=_md(OPERATOR))
    return float(reply.credential_grace_seconds)


def _register_code(stub: broker_pb2_grpc.BrokerServiceStub, replica_id: str, secret: str) -> grpc.StatusCode:
    try:
        _register(stub, replica(replica_id, common_pb2.REPLICA_ROLE_AR), replica_token_for(secret, replica_id))
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_a_broker_killed_in_the_grace_still_takes_the_replaced_tokens_until_it_ends(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "secret", OLD)
    _write(tmp_path / "operator.token", OPERATOR)
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"].update(journal_path=str(tmp_path / "state" / "broker.sqlite"), lease_seconds=60)
    cfg["security"] = {"replica_tokens": "bound", "replica_secret_file": str(tmp_path / "secret"),
                       "operator_token_file": str(tmp_path / "operator.token"),
                       "rotation_grace_seconds": GRACE_S}  # fmt: skip
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(cfg))

    broker = _start(repo_root, config)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            assert _register_code(stub, "ar-0", OLD) == grpc.StatusCode.OK
            _write(tmp_path / "secret", NEW)
            capsys.readouterr()
            code = main(["rotate-secrets", "--target", broker.address, "--token", OPERATOR])
            out, err = capsys.readouterr()
            assert code == 0 and "replica_secret: reloaded" in out, out + err
        # The answer came after the record was on disk: kill -9 now loses nothing.
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(10)
    finally:
        broker.stop()

    on_disk = b"".join(p.read_bytes() for p in (tmp_path / "state").iterdir() if p.name.startswith("broker.sqlite"))
    assert b"credential_grace" in on_disk
    for value in (OLD, NEW, replica_token_for(OLD, "ar-1"), replica_token_for(OLD, "ar-0")):
        assert value.encode() not in on_disk and value.encode().hex().encode() not in on_disk

    broker = _start(repo_root, config)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            left = _grace_left(stub)
            assert 0 < left <= GRACE_S, (left, broker.output())
            # Within the grace: a replica still on its token of the replaced secret registers.
            assert _register_code(stub, "ar-1", OLD) == grpc.StatusCode.OK, broker.output()
            assert _register_code(stub, "ar-2", NEW) == grpc.StatusCode.OK
            assert any('"credential_grace_restored"' in line for line in broker.lines), broker.output()
            # Once the grace is over (as the broker counts it), the old token is refused.
            deadline = time.monotonic() + GRACE_S + 60
            while _grace_left(stub) > 0:
                assert time.monotonic() < deadline, "the grace never ended"
                time.sleep(0.5)
            assert _register_code(stub, "ar-3", OLD) == grpc.StatusCode.UNAUTHENTICATED
            assert _register_code(stub, "ar-3", NEW) == grpc.StatusCode.OK
    finally:
        assert broker.stop() == 0, broker.output()

    # And a broker started after the grace takes only the new secret.
    broker = _start(repo_root, config)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            assert _grace_left(stub) == 0
            assert _register_code(stub, "ar-4", OLD) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        broker.stop()
