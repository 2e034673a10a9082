"""A vLLM-served AR with bound replica tokens (`security.replica_tokens: bound`) over the gRPC
fallback transport: the KvRelayConnector in vLLM's worker dials the DiT's PutKv as ar-0 and must
present the write token the broker gave with Prefill (ar-0's own token, the shared one or none is
refused by the DiT). A real node (`kvrelay up`'s supervisor: broker, vLLM AR, built-in DiT) makes
images and every DiT page comes back."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

pytest.importorskip("vllm", reason="engine: vllm needs vLLM (scripts/setup.sh --vllm)")

from kvrelay.client import KvRelayClient  # noqa: E402
from kvrelay.security import replica_token_for  # noqa: E402
from tests.e2e.node import fallback, running_node, wait_pools_full  # noqa: E402
from tests.vllm.checkpoint import build_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
SECRET = "vllm-bound-replica-secret"
OPERATOR = "vllm-bound-operator-token"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _events(log_dir: Path, name: str) -> list[dict[str, Any]]:
    lines = [line for f in log_dir.glob(f"{name}*.log") for line in f.read_text().splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_a_vllm_ar_writes_into_a_dit_with_bound_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVRELAY_API_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_OPERATOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVRELAY_REPLICA_SECRET", SECRET)
    monkeypatch.setenv("KVRELAY_OPERATOR_TOKEN", OPERATOR)
    checkpoint = build_checkpoint(tmp_path / "llama", seed=5)

    def edit(cfg: dict[str, Any]) -> None:
        fallback(cfg)  # PutKv over gRPC: the transport that carries the write token
        cfg["security"] = {"replica_tokens": "bound"}
        ar, dit = cfg["stages"]
        ar["model"] = {"engine": "vllm", "path": str(checkpoint), "vllm_args": {"max_model_len": 1024}}
        ar["request_timeout_seconds"] = 120
        # The DiT whose geometry is the checkpoint's (4 layers, 4 kv heads, head_dim 32, fp32).
        dit["model"] = {"preset": "small"}
        dit["request_timeout_seconds"] = 120

    with running_node(tmp_path, "vllm-bound", edit) as node:
        children = {p.name: p.pid for p in node.processes()}
        # The AR (and so vLLM's engine and its connector) holds ar-0's token only, not the secret.
        env = _environ(children["ar-0"])
        assert env.get("KVRELAY_REPLICA_SECRET") == "" and env["KVRELAY_REPLICA_TOKEN"] == replica_token_for(
            SECRET, "ar-0"
        )
        with KvRelayClient(node.address()) as client:
            # Two CFG rows (guidance 2.0), then one (guidance 1.0): two tickets' PutKv streams.
            first = client.generate("a red fox in the snow", seed=11, width=64, height=64, timeout=180).result()
            assert Image.open(io.BytesIO(first.png)).size == (64, 64)
            single = client.generate(
                "a lighthouse at night", seed=3, width=64, height=64, guidance_scale=1.0, timeout=180
            ).result()
            assert Image.open(io.BytesIO(single.png)).size == (64, 64)
        with KvRelayClient(node.address(), token=OPERATOR) as operator:
            assert {r.replica_id for r in operator.list_replicas() if r.up} == {"ar-0", "dit-0"}
            assert operator.list_tickets() == []
            wait_pools_full(operator)
        log_dir = tmp_path / "vllm-bound" / "logs"
        # The vLLM AR wrote both tickets' KV over the gRPC fallback (PutKv), every write OK.
        ar_events = _events(log_dir, "ar-0")
        assert [e["transport"] for e in ar_events if e.get("event") == "ar_serving"] == ["grpc"]
        written = [e for e in ar_events if e.get("event") == "ticket_written"]
        assert len(written) == 2 and all(e["ok"] == e["writes"] > 0 for e in written), written
        assert any("vllm" in str(e.get("line", "")).lower() for e in ar_events), "the AR did not run vLLM"
        refused = [e for f in ("ar-0", "dit-0") for e in _events(log_dir, f) if "REPLICA_TOKEN_MISMATCH" in json.dumps(e)]
        assert refused == [], refused[:3]
