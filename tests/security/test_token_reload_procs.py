"""Rotating the replica secret without restarting the replicas (docs/operations.md, Rotating the
replica secret): real `kvrelay broker`, `kvrelay ar` and `kvrelay dit` processes over the gRPC
fallback, each replica's token in its own file (`security.replica_token_file: .../{name}.token`).

The broker restarts with a new secret (bound tokens) or a new shared replica token: both replicas
are refused and NOT_SERVING. A token file replaced by bytes that are no token, deleted, or turned
into a FIFO does not stop the replica: it stays refused and logs why. Then the new tokens are
written into the files: both replicas take them on the next refusal, turn SERVING, and an image
comes out: the broker's call tokens (Tokenize, Prefill, Denoise) reach servers that now check
against the new token, and PutKv carries the new write token (bound) or shared token (shared)
from the AR's ranks, which were never restarted either. Same processes, same incarnations.
Before, a replica took a new token only from a restart."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import yaml
from PIL import Image

from kvrelay.client import KvRelayClient
from kvrelay.security import replica_token_for
from tests.procs import ServiceProcess, start_service
from tests.security.harness import REPO
from tests.security.test_credential_refused_procs import _free_port, _gauge, _health, _until

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


@pytest.mark.parametrize("mode", ["bound", "shared"])
def test_replicas_take_a_rotated_token_from_their_files_without_a_restart(mode: str, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
    data["security"] = {"replica_tokens": mode, "replica_token_file": str(tokens / "{name}.token")}
    for stage in data["stages"]:
        stage.pop("kv_transfer_config", None)  # the gRPC fallback: PutKv carries a credential
    config = tmp_path / "reload.yaml"
    config.write_text(yaml.safe_dump(data))
    port = _free_port()
    metrics = {name: _free_port() for name in REPLICAS}
    blank = {"KVRELAY_API_TOKEN": "", "KVRELAY_OPERATOR_TOKEN": "", "KVRELAY_REPLICA_TOKEN": "",
             "KVRELAY_REPLICA_SECRET": ""}  # fmt: skip

    def write_tokens(secret: str) -> None:
        for name in (*REPLICAS, "broker"):
            if name != "broker" or mode == "shared":
                _write_atomically(tokens / f"{name}.token", _token(mode, secret, name))

    def broker(secret: str) -> ServiceProcess:
        env = {**blank, "KVRELAY_OPERATOR_TOKEN": OPERATOR}
        if mode == "bound":
            env["KVRELAY_REPLICA_SECRET"] = secret
        return start_service(["broker", "--config", str(config), "--port", str(port), "--metrics-port", "0"],
                             cwd=tmp_path, env=env)  # fmt: skip

    def generate(seed: int) -> None:
        with KvRelayClient(f"127.0.0.1:{port}") as client:
            result = client.generate("a lighthouse at dusk", width=64, height=64, seed=seed, timeout=120).result()
        assert Image.open(io.BytesIO(result.png)).size == (64, 64)

    def incarnations() -> dict[str, str]:
        with KvRelayClient(f"127.0.0.1:{port}", token=OPERATOR) as operator:
            return {r.replica_id: r.incarnation_id for r in operator.list_replicas()}

    write_tokens(OLD)
    processes: list[ServiceProcess] = []
    replicas: dict[str, ServiceProcess] = {}
    try:
        processes.append(broker(OLD))
        for name in ("dit-0", "ar-0"):
            role = name.split("-")[0]
            replicas[name] = start_service(
                [role, "--config", str(config), "--port", "0", "--metrics-port", str(metrics[name]),
                 "--broker", f"127.0.0.1:{port}"],
                cwd=tmp_path, env=blank, timeout=120,
            )  # fmt: skip
            processes.append(replicas[name])
        for name, proc in replicas.items():
            _until(f"{name} SERVING", lambda p=proc: _health(p.address) == "SERVING", proc, timeout=120)
        generate(5)
        before = incarnations()

        # The rotation: the broker restarts with the new secret (shared: the new token in its file).
        assert processes.pop(0).stop() == 0
        if mode == "shared":
            _write_atomically(tokens / "broker.token", NEW)
        processes.insert(0, broker(NEW))
        for name, proc in replicas.items():
            _until(f"{name} NOT_SERVING", lambda p=proc: _health(p.address) == "NOT_SERVING", proc)
            assert _gauge(name.split("-")[0], metrics[name]) == 1.0

        # A token file that holds no token, is gone, or is a FIFO: refused, logged, the replica runs on.
        dit, path = replicas["dit-0"], tokens / "dit-0.token"
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
        write_tokens(NEW)
        for name, proc in replicas.items():
            _until(f"{name} SERVING again", lambda p=proc: _health(p.address) == "SERVING", proc)
            assert _gauge(name.split("-")[0], metrics[name]) == 0.0
            assert _count(proc, "credential_reloaded") == 1, proc.output()
        generate(6)
        assert incarnations() == before
        for name, proc in replicas.items():
            text = "".join(proc.lines)
            assert all(t not in text for t in (_token(mode, OLD, name), _token(mode, NEW, name))), name
            processes.remove(proc)
            assert proc.stop(timeout=30) == 0, proc.output()  # a clean stop: never fail-stopped
    finally:
        for proc in processes:
            proc.stop()
