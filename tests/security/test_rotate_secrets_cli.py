"""`kvrelay rotate-secrets` / BrokerService.ReloadCredentials against a real `kvrelay broker`
process (docs/client.md, kvrelay rotate-secrets; docs/operations.md, Rotating the replica
secret): only an operator may call it; a file that changed is taken and the old credential stays
taken for the grace; a file that holds no token makes the broker take nothing (exit 1, why on
stderr) and keep what it held; a credential from an environment variable is `not reloadable`;
kvrelay_broker_credential_reloads_total counts each outcome."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kvrelay.node.cli import main
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_forget_replica import _md, _register
from tests.broker.test_grpc import replica
from tests.procs import ServiceProcess, metrics_port_of, start_service

OLD_OPERATOR, NEW_OPERATOR = "rotate-cli-operator-old", "rotate-cli-operator-new"
REPLICA_OLD, REPLICA_NEW = "rotate-cli-replica-old", "rotate-cli-replica-new"
API = "rotate-cli-api-token"


@pytest.fixture(autouse=True)
def _no_ambient_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("KVRELAY_API_TOKEN", "KVRELAY_OPERATOR_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_REPLICA_SECRET"):
        monkeypatch.delenv(env, raising=False)


def _write(path: Path, text: str | bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(text if isinstance(text, bytes) else (text + "\n").encode())
    os.replace(tmp, path)


def _start_broker(repo_root: Path, tmp_path: Path) -> ServiceProcess:
    cfg = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    cfg["broker"].update(journal_path=str(tmp_path / "journal.sqlite"), lease_seconds=60)
    cfg["security"] = {"replica_token_file": str(tmp_path / "{name}.token"),
                       "operator_token_file": str(tmp_path / "operator.token")}  # fmt: skip
    config = tmp_path / "broker.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return start_service(["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"],
                         cwd=repo_root, env={"KVRELAY_API_TOKEN": API})  # fmt: skip


def _rotate(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["rotate-secrets", "--target", address, *args])
    out, err = capsys.readouterr()
    return code, out, err


def _status(capsys: pytest.CaptureFixture[str], address: str, token: str, *args: str) -> str:
    capsys.readouterr()
    code = main(["status", "--target", address, "--token", token, *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _reloads(broker: ServiceProcess) -> dict[str, float]:
    port = metrics_port_of(broker.lines)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvrelay_broker_credential_reloads_total{"):
            out[line.split('outcome="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def _code(stub: Any, token: str | None, replica_id: str | None = None) -> grpc.StatusCode:
    try:
        stub.ReloadCredentials(broker_pb2.ReloadCredentialsRequest(), timeout=10, metadata=_md(token, replica_id))
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_rotate_secrets_takes_changed_files_keeps_the_old_for_the_grace_and_takes_nothing_from_a_bad_file(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path / "operator.token", OLD_OPERATOR)
    _write(tmp_path / "broker.token", REPLICA_OLD)
    broker = _start_broker(repo_root, tmp_path)
    try:
        with grpc.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            assert _code(stub, None) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(stub, REPLICA_OLD, "ar-0") == grpc.StatusCode.PERMISSION_DENIED  # a replica is no operator
            assert _code(stub, API) == grpc.StatusCode.PERMISSION_DENIED

            code, out, err = _rotate(capsys, broker.address, "--token", OLD_OPERATOR)
            assert code == 0, err
            assert "operator_token: unchanged (security.operator_token_file (" in out
            assert "replica_token: unchanged" in out and "api_token: not reloadable (security.api_token_env" in out
            assert "nothing changed" in out
            assert "credential rotation grace" not in _status(capsys, broker.address, OLD_OPERATOR)
            assert json.loads(_status(capsys, broker.address, OLD_OPERATOR, "--json"))["credential_grace_seconds"] == 0

            # New operator and replica tokens in their files: taken, the old ones still taken.
            _write(tmp_path / "operator.token", NEW_OPERATOR)
            _write(tmp_path / "broker.token", REPLICA_NEW)
            code, out, err = _rotate(capsys, broker.address, "--token", OLD_OPERATOR)
            assert code == 0, err
            assert "operator_token: reloaded" in out and "replica_token: reloaded" in out
            assert "new credentials taken; the replaced ones are still taken for 300 s" in out
            for token in (OLD_OPERATOR, NEW_OPERATOR):
                assert _code(stub, token) == grpc.StatusCode.OK
            # kvrelay status shows the grace running and what is left of it (ListReplicas).
            out = _status(capsys, broker.address, NEW_OPERATOR)
            grace = [line for line in out.splitlines() if line.startswith("credential rotation grace: ")]
            assert len(grace) == 1 and grace[0].endswith("s left (the credentials `kvrelay rotate-secrets` "
                                                         "replaced are still taken until then)"), out
            assert 0 < int(grace[0].split()[3]) <= 300, grace
            left = json.loads(_status(capsys, broker.address, NEW_OPERATOR, "--json"))["credential_grace_seconds"]
            assert 0 < left <= 300, left
            _register(stub, replica("ar-0", common_pb2.REPLICA_ROLE_AR), REPLICA_OLD)
            _register(stub, replica("ar-1", common_pb2.REPLICA_ROLE_AR), REPLICA_NEW)

            # A file that holds no token: nothing taken, not even the operator file's new value.
            _write(tmp_path / "operator.token", "rotate-cli-operator-third")
            _write(tmp_path / "broker.token", b"\xff\xfe not text")
            code, out, err = _rotate(capsys, broker.address, "--token", NEW_OPERATOR, "--json")
            assert code == 1, (out, err)
            answer = json.loads(out)
            assert not answer["rotated"] and "security.replica_token_file" in answer["error"], answer
            assert {s["key"]: s["state"] for s in answer["sources"]}["replica_token"] == "failed"
            assert _code(stub, "rotate-cli-operator-third") == grpc.StatusCode.UNAUTHENTICATED
            assert _code(stub, NEW_OPERATOR) == grpc.StatusCode.OK
            code, out, err = _rotate(capsys, broker.address, "--token", NEW_OPERATOR)
            assert code == 1 and "kvrelay rotate-secrets: nothing taken: security.replica_token_file" in err, err
            # Every call taken is a reload: the CLI's 4 and the 3 raw calls that were let in.
            assert _reloads(broker) == {"reloaded": 1.0, "unchanged": 3.0, "failed": 3.0}
            assert "credentials_reload_failed" in broker.output()
    finally:
        assert broker.stop() == 0, broker.output()
