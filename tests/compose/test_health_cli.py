"""`kvrelay health`, the command every compose healthcheck runs: exit 0 only on SERVING, 1 when the
process answers anything else, 2 when nothing answers; as a real subprocess against a real gRPC
health server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvrelay.server import reserve_free_port


@pytest.fixture()
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(None)


def _health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrelay", "health", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )


def test_exit_code_follows_the_serving_status(health_server: tuple[str, health.HealthServicer]) -> None:
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    proc = _health("--target", target)
    # One line on stderr with the `kvrelay health: ` prefix of every subcommand's one-line error.
    assert proc.returncode == 1 and proc.stderr == f"kvrelay health: {target}: NOT_SERVING\n"

    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    proc = _health("--target", target)
    assert proc.returncode == 0 and proc.stdout.strip() == f"{target}: SERVING"

    # A named service the process does not know: NOT_FOUND, not serving.
    proc = _health("--target", target, "--service", "kvrelay.v1.NoSuchService")
    assert proc.returncode == 2 and proc.stderr.startswith(f"kvrelay health: {target}: NOT_FOUND")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_nothing_listening_is_exit_2_within_the_timeout() -> None:
    target = f"127.0.0.1:{reserve_free_port()}"
    proc = _health("--target", target, "--timeout", "1")
    assert proc.returncode == 2 and proc.stderr.startswith(f"kvrelay health: {target}: "), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stdout == "", proc.stderr


def test_a_target_without_a_port_dials_the_brokers_port_not_443() -> None:
    from kvrelay.node.health_probe import check

    # Nothing listens on 127.0.0.1:50051 here (port-0 tests); the line names the port it dialed.
    code, line = check("127.0.0.1", timeout_s=1.0)
    assert line.startswith("127.0.0.1:50051: ") and code in (0, 1, 2)
