"""A replica whose advertised endpoint the broker cannot reach is refused at registration.

Found with the broker, two ARs and two DiTs in five network namespaces: `dit-1` listening on
10.77.0.22 with `advertise_host: 10.77.0.99` (an address no host has) registered, showed UP in
`kvrelay status`, and every request placed on it failed `UNAVAILABLE REPLICA_UNAVAILABLE` (`No
route to host`, after up to 3 s). A failed call kept it out of placement only until its next
heartbeat, so about one request in 25 failed for as long as it ran. Now RegisterReplica dials the
advertised endpoint first and answers INVALID_ARGUMENT / UNREACHABLE_ENDPOINT, and the replica
fails at startup naming advertise_host."""

from __future__ import annotations

import socket
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from kvrelay.broker import service
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.service import BrokerServicer, grpc_endpoint_probe
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_grpc import TIMEOUT, expect_error, replica
from tests.orchestrator.harness import run


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_probe_tells_an_answering_server_from_an_address_nobody_serves() -> None:
    async def body() -> None:
        with_health = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), with_health)
        port = with_health.add_insecure_port("127.0.0.1:0")
        # A gRPC server without the health service still proves the address: UNIMPLEMENTED.
        bare = grpc.aio.server()
        bare_port = bare.add_insecure_port("127.0.0.1:0")
        await with_health.start()
        await bare.start()
        probe = grpc_endpoint_probe(timeout_s=2.0)
        try:
            assert await probe(f"127.0.0.1:{port}") == ""
            assert await probe(f"127.0.0.1:{bare_port}") == ""
            problem = await probe(f"127.0.0.1:{_closed_port()}")
            assert problem.startswith("UNAVAILABLE"), problem
            assert (await probe("")).startswith("UNKNOWN")  # no channel can be built: not a pass
        finally:
            await with_health.stop(0)
            await bare.stop(0)

    run(body(), timeout=20)


def _remote(ip: object) -> bool:
    return False


def test_register_replica_refuses_an_endpoint_the_broker_cannot_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[str] = []
    answer = {"problem": "UNAVAILABLE: failed to connect to all addresses; No route to host (113)"}

    async def probe(endpoint: str) -> str:
        probed.append(endpoint)
        return answer["problem"]

    async def body() -> None:
        core = BrokerCore(None, journal_synchronous="OFF")
        server = grpc.aio.server()
        broker_pb2_grpc.add_BrokerServiceServicer_to_server(BrokerServicer(core, endpoint_probe=probe), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            dit = replica("dit-1", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
            dit.endpoint = "10.77.0.99:50072"
            for region in dit.regions:
                region.endpoint = "10.77.0.99:16924"
            # The test's peer is loopback: pretend it is another host.
            monkeypatch.setattr(service, "is_local_address", _remote)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=TIMEOUT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = err.value.details() or ""
            assert "10.77.0.99:50072" in details and "advertise_host" in details and "No route to host" in details
            await expect_error(
                stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=TIMEOUT),
                grpc.StatusCode.INVALID_ARGUMENT, "UNREACHABLE_ENDPOINT",
            )
            assert probed == ["10.77.0.99:50072"] * 2
            assert core.list_replicas() == []
            # Reachable: registered as before.
            answer["problem"] = ""
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=TIMEOUT)
            assert [s.spec.replica_id for s in core.list_replicas()] == ["dit-1"]
        finally:
            await channel.close()
            await server.stop(0)
            core.close()

    run(body(), timeout=20)


@pytest.mark.parametrize(
    ("peer", "endpoint", "dialled"),
    [
        ("ipv4:127.0.0.1:40000", "127.0.0.1:50071", False),  # one host, loopback: kvrelay up, tests
        ("ipv4:127.0.0.1:40000", "10.0.0.5:50071", True),  # one host, but advertises another address
        ("ipv4:10.77.0.22:40000", "10.77.0.22:50072", True),  # another host
        ("ipv4:10.77.0.22:40000", "dit:50071", True),  # a name (compose): dialled as the broker resolves it
    ],
)
def test_which_registrations_are_dialled(peer: str, endpoint: str, dialled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[str] = []

    async def probe(target: str) -> str:
        probed.append(target)
        return ""

    monkeypatch.setattr(service, "is_local_address", lambda ip: ip.is_loopback)
    spec = service.spec_from_proto(replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16))
    spec = replace(spec, endpoint=endpoint)
    assert run(service.unreachable_endpoint_problem(spec, peer, probe), timeout=10) == ""
    assert probed == ([endpoint] if dialled else [])
