"""Rotating the replica secret without restarting the replicas (docs/operations.md, Rotating the
replica secret): real `kvrelay broker`, `kvrelay ar` and `kvrelay dit` processes over the gRPC
fallback, each replica's token in its own file (`security.replica_token_file: .../{name}.token`).

The documented order: the new tokens into the files, then the broker restarted with a new secret
(bound tokens) or a new shared replica token: each replica takes its new token at the first
refusal and is never shown refused. The other order: both replicas are refused and NOT_SERVING;
a token file replaced by bytes that are no token, deleted, or turned into a FIFO does not stop
the replica (it stays refused and logs why); the new tokens written into the files bring both
back. Either way an image comes out after: the broker's call tokens (Tokenize, Prefill, Denoise)
reach servers that now check against the new token, and PutKv carries the new write token
(bound) or shared token (shared) from the AR's ranks, which were never restarted either; status
lists the same incarnations, up, none refused. Before, a replica took a new token only from a
restart."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image

from kvrelay.client import KvRelayClient
from kvrelay.security import replica_token_for
from tests.procs import ServiceProcess, start_service
from tests.security.harness import REPO
from tests.security.test_credential_refused_procs import _free_port, _gauge, _health, _until
from tests.security.together import start_together, stop_together

pytestmark = pytest.mark.slow
OLD, NEW = "reload-old-secret-0123", "reload-new-secret-4567"
OPERATOR = "reload-operator-token"
REPLICAS = ("ar-0", "dit-0")


def _token(mode: str, secret: str, name: str) -> str:
    # Shared mode: one token for the whole deployment, the secret itself here.
    return replica_token_for(secret, name) if mode == "bound" else secret


def _write_atomically(path: Path, text: str) -> None:
    # As docs/operations.md says to: a replica re-reading the file never sees half of it.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _count(proc: ServiceProcess, event: str) -> int:
    return sum(f'"{event}"' in line for line in proc.lines)


class _Deployment:
    """A broker, `dit-0` and `ar-0` as processes, each replica's token in its own file."""

    def __init__(self, mode: str, tmp_path: Path) -> None:
        self.mode, self.cwd = mode, tmp_path
        self.tokens = tmp_path / "tokens"
        self.tokens.mkdir()
        data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
        data["security"] = {"replica_tokens": mode, "replica_token_file": str(self.tokens / "{name}.token")}
        for stage in data["stages"]:
            stage.pop("kv_transfer_config", None)  # the gRPC fallback: PutKv carries a credential
        self.config = tmp_path / "reload.yaml"
        self.config.write_text(yaml.safe_dump(data))
        self.port = _free_port()
        self.metrics = {name: _free_port() for name in REPLICAS}
        self.blank = {"KVRELAY_API_TOKEN": "", "KVRELAY_OPERATOR_TOKEN": "", "KVRELAY_REPLICA_TOKEN": "",
                      "KVRELAY_REPLICA_SECRET": ""}  # fmt: skip
        self.broker: ServiceProcess | None = None
        self.replicas: dict[str, ServiceProcess] = {}

    def write_tokens(self, secret: str) -> None:
        for name in (*REPLICAS, "broker"):
            if name != "broker" or self.mode == "shared":
                _write_atomically(self.tokens / f"{name}.token", _token(self.mode, secret, name))

    def start(self, secret: str) -> None:
        self.write_tokens(secret)
        self.start_broker(secret)
        # Side by side: each start is mostly an interpreter importing torch and loading a model.
        self.replicas = start_together({
            name: lambda name=name: start_service(
                [name.split("-")[0], "--config", str(self.config), "--port", "0", "--metrics-port",
                 str(self.metrics[name]), "--broker", f"127.0.0.1:{self.port}"],
                cwd=self.cwd, env=self.blank, timeout=120,
            )
            for name in ("dit-0", "ar-0")
        })  # fmt: skip
        self.until_serving("SERVING", timeout=120)

    def start_broker(self, secret: str) -> None:
        """Start the broker (stopping the one running): a rotation's restart. Shared mode: the
        token in its file is the secret."""
        if self.broker is not None:
            assert self.broker.stop() == 0
        env = {**self.blank, "KVRELAY_OPERATOR_TOKEN": OPERATOR}
        if self.mode == "bound":
            env["KVRELAY_REPLICA_SECRET"] = secret
        else:
            _write_atomically(self.tokens / "broker.token", secret)
        self.broker = start_service(
            ["broker", "--config", str(self.config), "--port", str(self.port), "--metrics-port", "0"],
            cwd=self.cwd, env=env,
        )  # fmt: skip

    def until_serving(self, status: str, timeout: float = 60.0) -> None:
        for name, proc in self.replicas.items():
            _until(f"{name} {status}", lambda p=proc: _health(p.address) == status, proc, timeout=timeout)
            assert _gauge(name.split("-")[0], self.metrics[name]) == (1.0 if status == "NOT_SERVING" else 0.0)

    def generate(self, seed: int) -> None:
        with KvRelayClient(f"127.0.0.1:{self.port}") as client:
            result = client.generate("a lighthouse at dusk", width=64, height=64, seed=seed, timeout=120).result()
        assert Image.open(io.BytesIO(result.png)).size == (64, 64)

    def registry(self) -> tuple[dict[str, tuple[str, bool]], list[str]]:
        """`kvrelay status`'s view: each replica's incarnation and whether it is up, and the ids
        refused for their credential."""
        with KvRelayClient(f"127.0.0.1:{self.port}", token=OPERATOR) as operator:
            registry = operator.get_replica_registry()
        replicas = {r.replica_id: (r.incarnation_id, r.up) for r in registry.replicas}
        return replicas, [r.replica_id for r in registry.credential_refusals]

    def stop(self, secrets: tuple[str, ...]) -> None:
        """Stop the replicas cleanly (never fail-stopped), checking that no log holds a token."""
        for name, proc in self.replicas.items():
            text = "".join(proc.lines)
            assert all(_token(self.mode, s, name) not in text for s in secrets), name
        # Side by side: each stop is mostly its server's and drain's graces.
        procs, self.replicas = self.replicas, {}
        codes = stop_together(procs, timeout=30)
        for name, proc in procs.items():
            assert codes[name] == 0, proc.output()

    def close(self) -> None:
        stop_together(self.replicas)
        if self.broker is not None:
            self.broker.stop()


def _wait_registry(deployment: _Deployment, replicas: dict[str, tuple[str, bool]], timeout: float = 30.0) -> None:
    """Until status lists `replicas` (the same incarnations: no restart) and no id refused."""
    deadline = time.monotonic() + timeout
    while (seen := deployment.registry()) != (replicas, []):
        assert time.monotonic() < deadline, (seen, replicas)
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["bound", "shared"])
def test_the_documented_rotation_new_token_files_then_the_broker_restart_never_shows_a_refusal(
    mode: str, tmp_path: Path
) -> None:
    deployment = _Deployment(mode, tmp_path)
    try:
        deployment.start(OLD)
        deployment.generate(5)
        before, refused = deployment.registry()
        assert all(up for _, up in before.values()) and refused == []
        # docs/operations.md, Rotating the replica secret: 1. the new tokens into the files (the
        # running replicas do not read them yet: their broker takes the old ones)...
        deployment.write_tokens(NEW)
        deployment.generate(6)
        # 2. the broker restarts with the new secret; 3. each replica's next call is refused, it
        # re-reads its file and presents the new token; 4. status: none refused, every replica up.
        deployment.start_broker(NEW)
        for name, proc in deployment.replicas.items():
            _until(f"{name} reloaded", lambda p=proc: _count(p, "credential_reloaded") == 1, proc)
        _wait_registry(deployment, before)
        deployment.until_serving("SERVING")
        deployment.generate(7)
        for proc in deployment.replicas.values():
            # Taken at the first refusal: never shown refused (no NOT_SERVING, the gauge stayed 0).
            assert _count(proc, "broker_refuses_credential") == 0, proc.output()
        deployment.stop((OLD, NEW))
    finally:
        deployment.close()


@pytest.mark.parametrize("mode", ["bound", "shared"])
def test_replicas_refused_after_a_rotation_take_their_new_token_files_and_survive_broken_ones(
    mode: str, tmp_path: Path
) -> None:
    deployment = _Deployment(mode, tmp_path)
    try:
        deployment.start(OLD)
        deployment.generate(5)
        before, _ = deployment.registry()
        # The broker first: both replicas still on their old tokens are refused.
        deployment.start_broker(NEW)
        deployment.until_serving("NOT_SERVING")

        # A token file that holds no token, is gone, or is a FIFO: refused, logged, the replica runs on.
        dit, path = deployment.replicas["dit-0"], deployment.tokens / "dit-0.token"
        path.write_bytes(b"\xff\xfe not text \x00")
        _until("garbage logged", lambda: _count(dit, "credential_reload_failed") == 1, dit)
        assert "not UTF-8" in dit.output()
        path.unlink()
        _until("missing file logged", lambda: _count(dit, "credential_reload_failed") == 2, dit)
        os.mkfifo(path)
        _until("FIFO logged", lambda: _count(dit, "credential_reload_failed") == 3, dit)
        assert "not a regular file" in dit.output()
        assert _health(dit.address) == "NOT_SERVING"
        path.unlink()

        # The new tokens in the files: taken on the next refusal, no restart.
        deployment.write_tokens(NEW)
        deployment.until_serving("SERVING")
        for proc in deployment.replicas.values():
            assert _count(proc, "credential_reloaded") == 1, proc.output()
        deployment.generate(6)
        _wait_registry(deployment, before)
        deployment.stop((OLD, NEW))
    finally:
        deployment.close()
