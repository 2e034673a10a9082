"""A broker killed (SIGKILL) during a credential rotation's grace still honours it once restarted
(broker/credential_grace.py; docs/operations.md, Rotating the replica secret): a real `kvrelay
broker` (bound replica tokens, the secret in a file) rotated with `kvrelay rotate-secrets`,
killed with kill -9 right after, started again on the same journal: a replica presenting its
token of the replaced secret still registers until the grace ends and is refused after it, and
the journal (with its WAL) holds neither secret nor any token in plaintext; and a replica that
switched to its new token before the kill is called by the restarted broker with that one."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvrelay.client import KvRelayClient, KvRelayError
from kvrelay.node.cli import main
from kvrelay.security import AUTHORIZATION_METADATA, broker_call_token, replica_token_for
from kvrelay.v1 import ar_pb2, ar_pb2_grpc, broker_pb2, broker_pb2_grpc, common_pb2
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


def _config(repo_root: Path, tmp_path: Path) -> Path:
    _write(tmp_path / "secret", OLD)
    _write(tmp_path / "operator.token", OPERATOR)
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"].update(journal_path=str(tmp_path / "state" / "broker.sqlite"), lease_seconds=60)
    cfg["security"] = {"replica_tokens": "bound", "replica_secret_file": str(tmp_path / "secret"),
                       "operator_token_file": str(tmp_path / "operator.token"),
                       "rotation_grace_seconds": GRACE_S}  # fmt: skip
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def _rotate(tmp_path: Path, address: str, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "secret", NEW)
    capsys.readouterr()
    code = main(["rotate-secrets", "--target", address, "--token", OPERATOR])
    out, err = capsys.readouterr()
    assert code == 0 and "replica_secret: reloaded" in out, out + err


def test_a_broker_killed_in_the_grace_still_takes_the_replaced_tokens_until_it_ends(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(repo_root, tmp_path)
    broker = _start(repo_root, config)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            assert _register_code(stub, "ar-0", OLD) == grpc.StatusCode.OK
            _rotate(tmp_path, broker.address, capsys)
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


class _Ar(ar_pb2_grpc.ArServiceServicer):  # type: ignore[misc]
    """An AR replica's Tokenize, as far as the broker's call token: what a real replica that
    holds only `token` takes (kvrelay.security's bound call token of it), every bearer kept."""

    def __init__(self, token: str) -> None:
        self.expected = broker_call_token(token)
        self.bearers: list[str] = []
        self.called = threading.Event()

    def Tokenize(self, request: ar_pb2.TokenizeRequest, context: Any) -> ar_pb2.TokenizeResponse:  # noqa: N802
        bearer = dict(context.invocation_metadata()).get(AUTHORIZATION_METADATA, "")
        self.bearers.append(bearer.removeprefix("Bearer "))
        self.called.set()
        if self.bearers[-1] != self.expected:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "not the broker's call token of the token held here")
        return ar_pb2.TokenizeResponse(token_counts=[4] * len(request.texts), max_tokens=1024)


@pytest.mark.slow
def test_a_broker_killed_in_the_grace_still_calls_a_replica_with_the_token_it_switched_to(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ar-0 registers on its token of the OLD secret, the broker rotates, ar-0 heartbeats on its
    NEW token and restarts holding the NEW token alone; the broker is killed (kill -9) and started
    again within the grace. The restarted broker calls ar-0 (Tokenize) with the call token of its
    NEW token, the only one ar-0 takes: a restored replica is placed only once it registered
    again (ReplicaRecord.needs_registration), and that registration, on the token it holds, is
    what tells the broker which generation it holds (CredentialRotation.seen), before any call.
    The broker calling it with what the oldest generation still taken derives from (as it does a
    replica it has not seen since the rotation) fails here: Tokenize UNAUTHENTICATED."""
    config = _config(repo_root, tmp_path)
    ar = _Ar(replica_token_for(NEW, "ar-0"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    ar_pb2_grpc.add_ArServiceServicer_to_server(ar, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    info = replica("ar-0", common_pb2.REPLICA_ROLE_AR)
    info.endpoint = f"127.0.0.1:{port}"
    try:
        broker = _start(repo_root, config)
        try:
            with grpc.insecure_channel(broker.address) as channel:
                stub = broker_pb2_grpc.BrokerServiceStub(channel)
                _register(stub, info, replica_token_for(OLD, "ar-0"))
                _rotate(tmp_path, broker.address, capsys)
                new = replica_token_for(NEW, "ar-0")
                reply = stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id="ar-0", incarnation_id=info.incarnation_id),
                                       timeout=10, metadata=_md(new, "ar-0"))  # fmt: skip
                assert not reply.credential_superseded
            broker.proc.send_signal(signal.SIGKILL)  # the heartbeat's answer came after its record
            broker.proc.wait(10)
        finally:
            broker.stop()

        broker = _start(repo_root, config)
        try:
            with grpc.insecure_channel(broker.address) as channel:
                stub = broker_pb2_grpc.BrokerServiceStub(channel)
                assert 0 < _grace_left(stub) <= GRACE_S, broker.output()
                # As every replica after a broker restart: registers again (its heartbeat is told
                # to), on the token it holds: the NEW one.
                _register(stub, info, replica_token_for(NEW, "ar-0"))
            with KvRelayClient(broker.address) as client:
                # No DiT is registered: the generation fails after the Tokenize it needs.
                with pytest.raises(KvRelayError) as err:
                    client.generate("a lighthouse", width=64, height=64, timeout=20).result()
            assert ar.called.is_set(), (err.value, broker.output())
            assert ar.bearers == [ar.expected], (err.value, broker.output())
            assert "UNAUTHENTICATED" not in str(err.value) and "Tokenize" not in str(err.value), err.value
        finally:
            assert broker.stop() == 0, broker.output()
    finally:
        server.stop(None)
