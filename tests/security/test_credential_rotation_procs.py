"""Hitless rotation of the replica secret (docs/operations.md, Rotating the replica secret): real
`kvrelay broker`, `kvrelay ar` and `kvrelay dit` processes (tiny CPU preset, the gRPC fallback so
that PutKv carries a write token), the broker's secret (bound) or shared token in a file, each
replica's token in its own file.

Generations run back to back on two clients from before the rotation until after its grace:
the new tokens go into the replicas' files, the new secret into the broker's, `kvrelay
rotate-secrets` makes the broker take it without a restart. No generation fails; each replica
takes its new token at its next heartbeat (credential_superseded -> credential_reloaded) and is
never refused or NOT_SERVING; the broker's call tokens and the AR's write tokens keep being
taken across the switch (else Prefill, Denoise or PutKv would fail a generation). During the
grace the broker still takes an old token; after it, the old tokens are refused by the broker
and by the replicas, and the new ones work. Before, rotating was a broker restart, failing the
generations live then (BROKER_SHUTTING_DOWN)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from kvrelay.client import KvRelayClient, KvRelayError
from kvrelay.security import AUTHORIZATION_METADATA, REPLICA_ID_METADATA, broker_call_token, replica_token_for
from kvrelay.v1 import ar_pb2, ar_pb2_grpc, broker_pb2, broker_pb2_grpc
from tests.procs import ServiceProcess, start_service
from tests.security.harness import REPO
from tests.security.test_credential_refused_procs import _free_port, _gauge, _health, _until
from tests.security.together import start_together, stop_together

pytestmark = pytest.mark.slow
OLD, NEW = "rotate-old-secret-0123", "rotate-new-secret-4567"
OPERATOR = "rotate-operator-token"
REPLICAS = ("ar-0", "dit-0")
# Long enough for every replica to switch (a heartbeat every lease / 3 = 0.67 s; seen within
# about 1 s) and for a transfer handed an old write token to end, on a loaded machine; short for
# the test, which waits it out (it was 15 s: the switch and three generations took about 2 s).
GRACE_S = 10.0


def _token(mode: str, secret: str, name: str) -> str:
    return replica_token_for(secret, name) if mode == "bound" else secret


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _count(proc: ServiceProcess, event: str) -> int:
    return sum(f'"{event}"' in line for line in proc.lines)


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


class _Generations:
    """Clients generating back to back until stopped; every outcome kept."""

    def __init__(self, port: int, clients: int = 2) -> None:
        self.port = port
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, index: int) -> None:
        seed = index * 1000
        with KvRelayClient(f"127.0.0.1:{self.port}") as client:
            while not self._stop.is_set():
                seed += 1
                try:
                    result = client.generate("a lighthouse at dusk", width=64, height=64, seed=seed, timeout=120).result()
                    assert result.png.startswith(b"\x89PNG")
                    with self._lock:
                        self.ok += 1
                except KvRelayError as err:
                    with self._lock:
                        self.failures.append(f"{err.code} {err.reason}: {err.message}")

    def until(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ok < count:
            assert not self.failures, self.failures
            assert time.monotonic() < deadline, f"{self.ok} generations within {timeout} s"
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


class _Deployment:
    def __init__(self, mode: str, tmp_path: Path) -> None:
        self.mode, self.cwd = mode, tmp_path
        self.tokens = tmp_path / "tokens"
        self.tokens.mkdir()
        self.secret_file = self.tokens / "broker.secret"
        data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
        security: dict[str, object] = {
            "replica_tokens": mode, "replica_token_file": str(self.tokens / "{name}.token"),
            "rotation_grace_seconds": GRACE_S,
        }  # fmt: skip
        if mode == "bound":
            security["replica_secret_file"] = str(self.secret_file)
        data["security"] = security
        for stage in data["stages"]:
            stage.pop("kv_transfer_config", None)  # the gRPC fallback: PutKv carries a write token
        self.config = tmp_path / "rotate.yaml"
        self.config.write_text(yaml.safe_dump(data))
        self.port = _free_port()
        self.metrics = {name: _free_port() for name in REPLICAS}
        self.env = {"KVRELAY_API_TOKEN": "", "KVRELAY_OPERATOR_TOKEN": "", "KVRELAY_REPLICA_TOKEN": "",
                    "KVRELAY_REPLICA_SECRET": ""}  # fmt: skip
        self.broker: ServiceProcess | None = None
        self.replicas: dict[str, ServiceProcess] = {}

    def write_replica_tokens(self, secret: str) -> None:
        for name in REPLICAS:
            _write_atomically(self.tokens / f"{name}.token", _token(self.mode, secret, name))

    def write_broker_secret(self, secret: str) -> None:
        # Bound: the secret file; shared: the broker's own token file ({name} = broker).
        _write_atomically(self.secret_file if self.mode == "bound" else self.tokens / "broker.token", secret)

    def start(self, secret: str) -> None:
        self.write_replica_tokens(secret)
        self.write_broker_secret(secret)
        self.broker = start_service(
            ["broker", "--config", str(self.config), "--port", str(self.port), "--metrics-port", "0"],
            cwd=self.cwd, env={**self.env, "KVRELAY_OPERATOR_TOKEN": OPERATOR},
        )  # fmt: skip
        # Side by side: each start is mostly an interpreter importing torch and loading a model.
        self.replicas = start_together({
            name: lambda name=name: start_service(
                [name.split("-")[0], "--config", str(self.config), "--port", "0", "--metrics-port",
                 str(self.metrics[name]), "--broker", f"127.0.0.1:{self.port}"],
                cwd=self.cwd, env=self.env, timeout=120,
            )
            for name in ("dit-0", "ar-0")
        })  # fmt: skip
        for name, proc in self.replicas.items():
            _until(f"{name} SERVING", lambda p=proc: _health(p.address) == "SERVING", proc, timeout=120)

    def rotate_secrets(self) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "kvrelay", "rotate-secrets", "--target", f"127.0.0.1:{self.port}",
             "--token", OPERATOR],
            cwd=self.cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def broker_takes(self, token: str, replica_id: str) -> grpc.StatusCode:
        """What the broker answers a replica call presenting `token` as `replica_id` (GetTicket of
        no ticket: NOT_FOUND once authenticated)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            md = ((AUTHORIZATION_METADATA, f"Bearer {token}"), (REPLICA_ID_METADATA, replica_id))
            return _code(lambda: stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id="no-such-ticket"),
                                                metadata=md, timeout=10))  # fmt: skip

    def ar_takes_from_broker(self, secret: str) -> grpc.StatusCode:
        """What ar-0 answers a Tokenize presenting the broker's call token under `secret`."""
        token = _token(self.mode, secret, "ar-0")
        bearer = broker_call_token(token) if self.mode == "bound" else token
        with grpc.insecure_channel(self.replicas["ar-0"].address) as channel:
            stub = ar_pb2_grpc.ArServiceStub(channel)
            md = ((AUTHORIZATION_METADATA, f"Bearer {bearer}"), (REPLICA_ID_METADATA, "broker"))
            return _code(lambda: stub.Tokenize(ar_pb2.TokenizeRequest(texts=["a fox"]), metadata=md, timeout=10))

    def refused_ids(self) -> list[str]:
        with KvRelayClient(f"127.0.0.1:{self.port}", token=OPERATOR) as operator:
            registry = operator.get_replica_registry()
        assert all(r.up for r in registry.replicas), registry.replicas
        return [r.replica_id for r in registry.credential_refusals]

    def close(self) -> None:
        stop_together(self.replicas)
        if self.broker is not None:
            self.broker.stop()


@pytest.mark.parametrize("mode", ["bound", "shared"])
def test_rotating_the_secret_while_generations_run_fails_none_and_refuses_the_old_tokens_after_the_grace(
    mode: str, tmp_path: Path
) -> None:
    deployment = _Deployment(mode, tmp_path)
    generations = _Generations(deployment.port)
    try:
        deployment.start(OLD)
        incarnations = {n: _count(p, "replica_registered") for n, p in deployment.replicas.items()}
        generations.start()
        generations.until(2)

        # docs/operations.md: 1. the replicas' new tokens into their files, 2. the broker's new
        # secret into its file, 3. kvrelay rotate-secrets, while generations run.
        deployment.write_replica_tokens(NEW)
        deployment.write_broker_secret(NEW)
        before = generations.ok
        out = deployment.rotate_secrets()
        rotated_at = time.monotonic()
        key = "replica_secret" if mode == "bound" else "replica_token"
        assert f"{key}: reloaded" in out and "operator_token: not reloadable" in out, out
        assert "new credentials taken" in out, out
        # During the grace the broker still takes an old token (the replicas' own switch soon).
        assert deployment.broker_takes(_token(mode, OLD, "ar-0"), "ar-0") == grpc.StatusCode.NOT_FOUND

        # 4. each replica takes its new token at its next heartbeat, never refused.
        for name, proc in deployment.replicas.items():
            _until(f"{name} reloaded", lambda p=proc: _count(p, "credential_reloaded") == 1, proc, timeout=GRACE_S)
        # Each replica's own grace started when it swapped, before this saw its line.
        reloaded_seen = time.monotonic()
        # ar-0 holds its new token and, for its own grace, still takes the broker's call token of
        # the old one (a call the broker sent before it saw ar-0's new token).
        assert deployment.ar_takes_from_broker(OLD) == grpc.StatusCode.OK
        assert deployment.ar_takes_from_broker(NEW) == grpc.StatusCode.OK
        generations.until(before + 3)
        remaining = GRACE_S - (time.monotonic() - rotated_at)
        assert remaining > 0, "the replicas switched only after the grace: the test proves nothing"
        # Past the broker's grace (it started before rotate-secrets answered, before rotated_at)
        # and the replicas' own (they started before reloaded_seen), plus a margin.
        time.sleep(max(remaining, GRACE_S - (time.monotonic() - reloaded_seen)) + 1.0)
        after_grace = generations.ok
        generations.until(after_grace + 2)
        generations.stop()
        assert generations.failures == [], generations.failures
        print(f"{mode}: {generations.ok} generations across the rotation and its grace, none failed")

        for name, proc in deployment.replicas.items():
            assert _count(proc, "broker_refuses_credential") == 0, proc.output()
            assert _count(proc, "replica_registered") == incarnations[name], proc.output()  # no re-registration
            assert _health(proc.address) == "SERVING"
            assert _gauge(name.split("-")[0], deployment.metrics[name]) == 0.0
        assert deployment.refused_ids() == []
        # Not even a retried attempt: the broker retries a generation whose replica or transfer
        # failed, which would hide a refused Prefill, Denoise or PutKv from the clients.
        assert deployment.broker is not None
        assert _count(deployment.broker, "generation_retried") == 0, deployment.broker.output()
        # 5. after the grace: the old tokens are refused by the broker and by the replicas, the new taken.
        assert deployment.broker_takes(_token(mode, OLD, "ar-0"), "ar-0") == grpc.StatusCode.UNAUTHENTICATED
        assert deployment.broker_takes(_token(mode, NEW, "ar-0"), "ar-0") == grpc.StatusCode.NOT_FOUND
        assert deployment.ar_takes_from_broker(OLD) == grpc.StatusCode.UNAUTHENTICATED
        assert deployment.ar_takes_from_broker(NEW) == grpc.StatusCode.OK
        # A second call finds nothing new.
        assert "nothing changed" in deployment.rotate_secrets()
    finally:
        generations.stop()
        deployment.close()
