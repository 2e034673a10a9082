"""A request id held by a live ticket made by hand (the operator's BrokerService.CreateTicket) is
refused to Generate, with real processes (`kvrelay up`'s supervisor: broker, AR, DiT, tiny preset,
Mooncake TCP) and across a broker killed (`kill -9`) and restarted on its journal: ALREADY_EXISTS
REQUEST_ID_REUSED through the SDK (which does not retry it), nothing accepted under the id, the
queue not held; the restart ends the ticket's request (never armed: rolled back), so the id is free
afterwards, and the restarted broker refuses both ways again (docs/api.md, Idempotency)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvrelay.client import KvRelayClient, KvRelayError, ReplicaRole
from kvrelay.errors import reason_of
from kvrelay.v1 import broker_pb2, broker_pb2_grpc
from tests.e2e.node import running_node, wait_broker, wait_pools_full

pytestmark = pytest.mark.slow


def _generate(client: KvRelayClient, request_id: str) -> Any:
    return client.generate(
        "a red fox", seed=5, width=64, height=64, request_id=request_id, timeout=60
    ).result()


def _refused_generate(client: KvRelayClient, request_id: str) -> str:
    with pytest.raises(KvRelayError) as info:
        _generate(client, request_id)
    assert (info.value.code, info.value.reason) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED"), info.value
    return info.value.message


def test_generate_refuses_the_id_of_a_live_hand_made_ticket_before_and_after_a_broker_restart(
    tmp_path: Path,
) -> None:
    with running_node(tmp_path, "handids") as node, KvRelayClient(node.address(), timeout=30) as client:
        wait_pools_full(client)
        replicas = client.list_replicas()
        ar = next(r.replica_id for r in replicas if r.role is ReplicaRole.AR)
        dit = next(r.replica_id for r in replicas if r.role is ReplicaRole.DIT)
        with grpc.insecure_channel(node.address()) as channel:
            stub = broker_pb2_grpc.BrokerServiceStub(channel)

            def create(request_id: str) -> Any:
                return stub.CreateTicket(broker_pb2.CreateTicketRequest(
                    request_id=request_id, ar_replica_id=ar, dit_replica_id=dit, row_token_counts=[8]
                ), timeout=30, wait_for_ready=True).ticket  # fmt: skip

            hand = create("hand")
            message = _refused_generate(client, "hand")
            assert hand.ticket_id in message and "CreateTicket" in message, message
            with pytest.raises(KvRelayError) as missing:
                client.get_generation("hand")
            assert missing.value.code == "NOT_FOUND"
            assert _generate(client, "other").png  # the queue was not held by the refused one
            assert [t.ticket_id for t in client.list_tickets()] == [hand.ticket_id]

            broker_pid = node.process("broker").pid
            os.kill(broker_pid, signal.SIGKILL)
            wait_broker(client)
            assert node.process("broker").pid != broker_pid
            # The restart ended the hand-made ticket's request (never armed: rolled back): the
            # id is free, and the generation made under it is served.
            assert client.list_tickets() == []
            assert _generate(client, "hand").png
            # The restarted broker refuses both ways: CreateTicket of the generation's id, and
            # Generate of a new hand-made ticket's id (a resubmission too).
            with pytest.raises(grpc.RpcError) as info:
                create("hand")
            assert reason_of(info.value)[:2] == ("ALREADY_EXISTS", "REQUEST_ID_REUSED")
            again = create("hand-2")
            for _ in range(2):
                assert again.ticket_id in _refused_generate(client, "hand-2")
            stub.CancelTicket(broker_pb2.CancelTicketRequest(ticket_id=again.ticket_id), timeout=30)
            assert _generate(client, "hand-2").png
            wait_pools_full(client)
