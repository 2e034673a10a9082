"""A real node (broker, AR, DiT processes) with bound replica tokens over the gRPC fallback
transport: `kvrelay up` gives each child its own token and only the broker the secret; the
broker's call tokens reach the AR and DiT, Prefill's write token opens PutKv. An image comes out;
then a holder of ar-0's token tries to register a new incarnation of the live dit-0 (which would
free its pages) and to release and heartbeat as dit-0: all refused, and dit-0 serves on."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image

from kvrelay.client import KvRelayClient
from kvrelay.errors import reason_of
from kvrelay.security import ChannelSecurity, make_sync_channel, replica_token_for
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
from tests.e2e.node import fallback, running_node, wait_pools_full

pytestmark = pytest.mark.slow
SECRET = "e2e-bound-replica-secret"
OPERATOR = "e2e-operator-token"
API = "e2e-api-token"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_a_bound_node_generates_and_a_replica_cannot_act_as_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVRELAY_API_TOKEN", "KVRELAY_REPLICA_TOKEN", "KVRELAY_OPERATOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVRELAY_REPLICA_SECRET", SECRET)
    monkeypatch.setenv("KVRELAY_OPERATOR_TOKEN", OPERATOR)
    monkeypatch.setenv("KVRELAY_API_TOKEN", API)

    def edit(cfg: dict[str, Any]) -> None:
        fallback(cfg)
        cfg["security"] = {"replica_tokens": "bound"}

    with running_node(tmp_path, "bound", edit) as node:
        target = node.address()
        children = {p.name: p.pid for p in node.processes()}
        for name in ("ar-0", "dit-0"):
            env = _environ(children[name])
            assert env.get("KVRELAY_REPLICA_SECRET") == "" and env["KVRELAY_REPLICA_TOKEN"] == replica_token_for(
                SECRET, name
            )
            # Nor the node's api and operator tokens: with them, a replica taken over was an operator.
            assert env.get("KVRELAY_OPERATOR_TOKEN") == "" and env.get("KVRELAY_API_TOKEN") == "", name
        with KvRelayClient(target, token=API) as client:
            result = client.generate("a lighthouse at dusk", width=64, height=64, seed=5, timeout=120).result()
            assert Image.open(io.BytesIO(result.png)).size == (64, 64)
        with KvRelayClient(target, token=OPERATOR) as operator:
            wait_pools_full(operator)
            before = {r.replica_id: r.incarnation_id for r in operator.list_replicas()}

        with make_sync_channel(target, ChannelSecurity(token=OPERATOR)) as channel:
            listed = broker_pb2_grpc.BrokerServiceStub(channel).ListReplicas(broker_pb2.ListReplicasRequest(), timeout=10)
        dit = next(r for r in listed.replicas if r.replica_id == "dit-0")
        # dit-0's registration as the broker lists it, under a new incarnation: the broker would
        # take it as proof that dit-0's process is gone and free its pages.
        impostor = broker_pb2.ReplicaInfo()
        impostor.CopyFrom(dit)
        impostor.incarnation_id = "dit-0-impostor"
        ar_token = replica_token_for(SECRET, "ar-0")
        attempts = {
            "RegisterReplica": broker_pb2.RegisterReplicaRequest(replica=impostor),
            "Heartbeat": broker_pb2.HeartbeatRequest(replica_id="dit-0", incarnation_id=dit.incarnation_id),
            "DeregisterReplica": broker_pb2.DeregisterReplicaRequest(replica_id="dit-0",
                                                                     incarnation_id=dit.incarnation_id),
        }  # fmt: skip
        with make_sync_channel(target, ChannelSecurity(token=ar_token, replica_id="dit-0")) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)
            for call, request in attempts.items():
                with pytest.raises(grpc.RpcError) as info:
                    getattr(stub, call)(request, timeout=10)
                code, reason, message = reason_of(info.value)
                assert (code, reason) == ("UNAUTHENTICATED", "REPLICA_TOKEN_MISMATCH"), (call, message)
                assert SECRET not in message and ar_token not in message

        with KvRelayClient(target, token=OPERATOR) as operator:
            assert {r.replica_id: r.incarnation_id for r in operator.list_replicas()} == before
            wait_pools_full(operator)
        with KvRelayClient(target, token=API) as client:
            again = client.generate("a fox in the snow", width=64, height=64, seed=6, timeout=120).result()
            assert Image.open(io.BytesIO(again.png)).size == (64, 64)
