"""The real processes: a `kvrelay ar` or `kvrelay dit` whose broker restarts with a rotated
replica secret turns its gRPC health NOT_SERVING and `kvrelay_{ar,dit}_credential_refused` 1 (what a readiness probe,
`kvrelay health` and a scrape see), keeps running, and is SERVING with the gauge 0 again once a
broker with its secret takes it. Before, it logged `heartbeat_failed` every heartbeat forever and
looked healthy."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.security import replica_token_for
from kvrelay.server import reserve_free_port
from tests.procs import ServiceProcess, start_service
from tests.security.harness import REPO

pytestmark = pytest.mark.slow
OLD, NEW = "rotation-old-secret-0123", "rotation-new-secret-4567"


def _free_port() -> int:
    return reserve_free_port()


def _health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _gauge(role: str, metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith(f"kvrelay_{role}_credential_refused "):
            return float(line.split()[1])
    raise AssertionError(f"kvrelay_{role}_credential_refused not served")


def _until(what: str, check: object, proc: ServiceProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, proc.output()
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout} s:\n{proc.output()}")


@pytest.mark.parametrize("role", ["ar", "dit"])
def test_a_replica_refused_after_a_rotation_is_not_ready_until_a_broker_takes_it(role: str, tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["security"] = {"replica_tokens": "bound"}
    data["stages"][0]["kv_transfer_config"] = None
    data["stages"][1]["kv_transfer_config"] = None
    config = tmp_path / "bound.yaml"
    config.write_text(yaml.safe_dump(data))
    port, metrics_port = _free_port(), _free_port()
    blank = {"KVRELAY_API_TOKEN": "", "KVRELAY_OPERATOR_TOKEN": "", "KVRELAY_REPLICA_TOKEN": "", "KVRELAY_REPLICA_SECRET": ""}

    def broker(secret: str) -> ServiceProcess:
        return start_service(["broker", "--config", str(config), "--port", str(port), "--metrics-port", "0"],
                             cwd=tmp_path, env={**blank, "KVRELAY_REPLICA_SECRET": secret})  # fmt: skip

    processes: list[ServiceProcess] = []
    try:
        processes.append(broker(OLD))
        name = f"{role}-0"
        replica = start_service(
            [role, "--config", str(config), "--port", "0", "--metrics-port", str(metrics_port),
             "--broker", f"127.0.0.1:{port}"],
            cwd=tmp_path, env={**blank, "KVRELAY_REPLICA_TOKEN": replica_token_for(OLD, name)}, timeout=120,
        )  # fmt: skip
        processes.append(replica)
        _until(f"{name} SERVING", lambda: _health(replica.address) == "SERVING", replica, timeout=120)
        assert _gauge(role, metrics_port) == 0.0
        # The rotation: the broker restarts with a new secret; the replica still holds its old token.
        assert processes.pop(0).stop() == 0
        processes.append(broker(NEW))
        _until(f"{name} NOT_SERVING", lambda: _health(replica.address) == "NOT_SERVING", replica)
        assert _gauge(role, metrics_port) == 1.0
        refusals = "".join(replica.lines).count('"broker_refuses_credential"')
        assert refusals == 1, replica.output()
        assert f"kvrelay token {name}" in replica.output()
        # The broker given its old secret back: taken again, ready again.
        assert processes.pop().stop() == 0
        processes.append(broker(OLD))
        _until(f"{name} SERVING again", lambda: _health(replica.address) == "SERVING", replica)
        assert _gauge(role, metrics_port) == 0.0
        processes.remove(replica)
        assert replica.stop(timeout=30) == 0, replica.output()  # a clean stop: never fail-stopped
    finally:
        for proc in processes:
            proc.stop()
