"""Hostile messages from callers that pass authorization (hypothesis, the CI profile), against a
real node (broker, AR, DiT processes) with bound replica tokens over the gRPC fallback.

tests/security/test_fuzz.py sends hostile messages as callers the interceptor refuses (anonymous,
a wrong replica, an api client), so the handlers of the AR's and DiT's RPCs, which only the broker
may call, never saw them. Here each RPC gets them from the caller it admits: ArService and
DitService from the broker (its call token for that replica; PutKv from ar-0 with its write
token), BrokerService's replica RPCs from ar-0 and dit-0 (each with its own token). Found this
way: a `deadline_time` outside Timestamp's range ended Prefill and Denoise UNKNOWN (a ValueError
from Timestamp.ToNanoseconds()). No answer may be UNKNOWN, INTERNAL or DATA_LOSS, no process may
stop, and afterwards the node still generates an image and every page comes back.

RPCs that end a replica's registration (RegisterReplica, DeregisterReplica, ForgetReplica) and the
operator's are left out: what they may do to the caller's own registration is their purpose.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from kvrelay.client import KvRelayClient
from kvrelay.security import (
    ChannelSecurity,
    broker_call_token,
    make_sync_channel,
    put_kv_token,
    replica_token_for,
)
from kvrelay.v1 import ar_pb2, broker_pb2, dit_pb2
from tests.e2e.node import fallback, running_node, wait_pools_full
from tests.security.test_fuzz import NEVER, ident, payloads

pytestmark = pytest.mark.slow

SECRET = "authorized-fuzz-replica-secret"
OPERATOR = "authorized-fuzz-operator-token"
API = "authorized-fuzz-api-token"
LEFT_OUT = {"RegisterReplica", "DeregisterReplica", "ForgetReplica"}
REPLICA_RPCS = {"Heartbeat", "ReserveTicket", "ReportWrite", "ReportLoad", "ReleaseTicket", "StartConsuming",
                "CancelTicket", "GetTicket", "WatchTicket"}  # fmt: skip


def _token(replica_id: str) -> str:
    return replica_token_for(SECRET, replica_id)


# (server role, method path, method descriptor, the security of the caller it admits)
def _targets() -> list[tuple[str, str, _descriptor.MethodDescriptor, ChannelSecurity]]:
    out: list[tuple[str, str, _descriptor.MethodDescriptor, ChannelSecurity]] = []
    for role, pb in (("ar-0", ar_pb2), ("dit-0", dit_pb2)):
        svc = pb.DESCRIPTOR.services_by_name["ArService" if role == "ar-0" else "DitService"]
        for m in svc.methods:
            if m.name == "PutKv":
                security = ChannelSecurity(token=put_kv_token(_token("dit-0"), "ar-0"), replica_id="ar-0")
            else:
                security = ChannelSecurity(token=broker_call_token(_token(role)), replica_id="broker")
            out.append((role, f"/{svc.full_name}/{m.name}", m, security))
    broker = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"]
    for m in broker.methods:
        if m.name in REPLICA_RPCS:
            for replica_id in ("ar-0", "dit-0"):
                out.append(("broker", f"/{broker.full_name}/{m.name}", m,
                            ChannelSecurity(token=_token(replica_id), replica_id=replica_id)))  # fmt: skip
    return out


TARGETS = _targets()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("authorized-fuzz")
    mp = pytest.MonkeyPatch()
    mp.delenv("KVRELAY_REPLICA_TOKEN", raising=False)
    mp.setenv("KVRELAY_REPLICA_SECRET", SECRET)
    mp.setenv("KVRELAY_OPERATOR_TOKEN", OPERATOR)
    mp.setenv("KVRELAY_API_TOKEN", API)

    def edit(cfg: dict[str, Any]) -> None:
        fallback(cfg)
        cfg["security"] = {"replica_tokens": "bound"}

    try:
        with running_node(tmp, "authorized-fuzz", edit) as running:
            yield running
    finally:
        mp.undo()


def _call(address: str, path: str, method: _descriptor.MethodDescriptor, security: ChannelSecurity,
          messages: list[bytes]) -> str:  # fmt: skip
    with make_sync_channel(address, security) as channel:
        try:
            if method.client_streaming:
                channel.stream_unary(path, ident, ident)(iter(messages), timeout=10)
            elif method.server_streaming:
                responses = channel.unary_stream(path, ident, ident)(messages[0], timeout=10)
                next(iter(responses), None)
                responses.cancel()
            else:
                channel.unary_unary(path, ident, ident)(messages[0], timeout=10)
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.CANCELLED and method.server_streaming:
                return "OK"  # we cancelled it after the first answer
            return f"{code.name}: {err.details()}"  # type: ignore[attr-defined]
    return "OK"


# More examples than the CI profile's 40: 18 targets, and a field such as a nested Timestamp is
# drawn hostile in few of them; each example is one call to a running node (milliseconds).
@settings(max_examples=400)
@given(data=st.data())
def test_hostile_messages_from_the_callers_each_rpc_admits(node: Any, data: st.DataObject) -> None:
    role, path, method, security = data.draw(st.sampled_from(TARGETS), label="target")
    count = data.draw(st.integers(1, 3)) if method.client_streaming else 1
    messages = [data.draw(payloads(method), label="payload") for _ in range(count)]
    address = node.address() if role == "broker" else node.process(role).address
    answer = _call(address, path, method, security, messages)
    assert answer.split(":")[0] not in NEVER, (path, security.replica_id, answer)


def test_the_node_is_whole_after_the_fuzz(node: Any) -> None:
    """Runs after the fuzz (file order): every process still up, an image made, every page free."""
    assert {p.name for p in node.processes()} == {"broker", "ar-0", "dit-0"}
    with KvRelayClient(node.address(), token=API) as client:
        result = client.generate("a lighthouse at dusk", width=64, height=64, seed=5, timeout=120).result()
        assert Image.open(io.BytesIO(result.png)).size == (64, 64)
    with KvRelayClient(node.address(), token=OPERATOR) as operator:
        wait_pools_full(operator)
