"""A real node (broker, AR, DiT processes) with the three tokens set, over the gRPC fallback
transport, so every internal call carries a credential: registration and heartbeats, the
orchestrator's Tokenize/Prefill/Denoise, ReserveTicket/ReportWrite/ReportLoad/ReleaseTicket,
the DiT's WatchTicket stream and the AR's PutKv. An image comes out, an anonymous caller gets
nothing, and the operator sees the pools full afterwards."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from kvrelay.client import KvRelayClient, KvRelayError, RetryPolicy
from kvrelay.client.cli import run_status
from tests.e2e.node import fallback, running_node, wait_pools_full

pytestmark = pytest.mark.slow
TOKENS = {"api": "e2e-api-token", "replica": "e2e-replica-token", "operator": "e2e-operator-token"}


def test_a_node_with_tokens_generates_and_refuses_anonymous_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("KVRELAY_API_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_OPERATOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)

    def edit(cfg: dict[str, Any]) -> None:
        fallback(cfg)
        cfg["security"] = {}
        for name, secret in TOKENS.items():
            (tmp_path / f"{name}.token").write_text(secret + "\n")
            cfg["security"][f"{name}_token_file"] = str(tmp_path / f"{name}.token")

    with running_node(tmp_path, "tokens", edit) as node:
        target = node.address()
        with KvRelayClient(target, token=TOKENS["api"]) as client:
            result = client.generate("a lighthouse at dusk", width=64, height=64, seed=5, timeout=120).result()
            assert Image.open(io.BytesIO(result.png)).size == (64, 64)
        with KvRelayClient(target, retry=RetryPolicy(max_attempts=1)) as anonymous:
            with pytest.raises(KvRelayError) as info:
                anonymous.generate("a fox", width=64, height=64).result()
            assert info.value.code == "UNAUTHENTICATED"
            with pytest.raises(KvRelayError) as info:
                anonymous.list_replicas()
            assert info.value.code == "UNAUTHENTICATED"
        with KvRelayClient(target, token=TOKENS["operator"]) as operator:
            assert {r.replica_id for r in operator.list_replicas()} == {"ar-0", "dit-0"}
            wait_pools_full(operator)
        status = argparse.Namespace(target=target, json=False, token=TOKENS["operator"], tls_ca=None,
                                    tls_cert=None, tls_key=None)  # fmt: skip
        assert run_status(status) == 0
        assert "dit-0" in capsys.readouterr().out
