"""A replica on another host that advertises a loopback endpoint is refused at registration.

Found with a DiT in its own network namespace started as `kvrelay dit --host 10.77.7.4` with the
config's `advertise_host: 127.0.0.1`: it registered as `127.0.0.1:50072`, the broker called its
own host's loopback for every Denoise and ARs wrote KV into their own loopback, so each request
placed on it failed. Now RegisterReplica answers INVALID_ARGUMENT / LOOPBACK_ENDPOINT and the
replica fails at startup with a message naming advertise_host."""

from __future__ import annotations

import ipaddress
from dataclasses import replace

import grpc
import pytest

from kvrelay.broker import service
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import MemoryRegionSpec
from kvrelay.broker.service import add_broker_servicer, loopback_endpoint_problem
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.helpers import ar_spec, dit_spec
from tests.broker.test_grpc import TIMEOUT, expect_error, replica
from tests.orchestrator.harness import run


def _remote(ip: object) -> bool:
    return False


def _local(ip: object) -> bool:
    return True


def test_a_loopback_endpoint_from_another_host_is_the_problem_named() -> None:
    dit = dit_spec()  # endpoint and regions on 127.0.0.1
    problem = loopback_endpoint_problem(dit, "ipv4:10.77.7.4:40000", _remote)
    assert "replica.endpoint" in problem and "10.77.7.4" in problem and "advertise_host" in problem
    # An IPv4 peer seen through a dual-stack listener is the same host.
    assert "10.77.7.4" in loopback_endpoint_problem(dit, "ipv6:[::ffff:10.77.7.4]:40000", _remote)
    # Only the Mooncake region is on loopback: that is named.
    remote_endpoint = replace(dit, endpoint="10.77.7.4:50071")
    assert "replica.regions[0].endpoint" in loopback_endpoint_problem(remote_endpoint, "ipv4:10.77.7.4:1", _remote)
    # A name (compose's `dit`) may resolve anywhere: nothing to prove.
    named = replace(dit, endpoint="dit:50071", regions=(MemoryRegionSpec(0, "mooncake", "dit:15000", 4096, 1 << 20),))
    assert loopback_endpoint_problem(named, "ipv4:10.77.7.4:1", _remote) == ""
    assert "localhost" in loopback_endpoint_problem(replace(named, endpoint="localhost:1"), "ipv4:10.77.7.4:1", _remote)


@pytest.mark.parametrize(
    "peer", ["ipv4:127.0.0.1:40000", "ipv6:[::1]:40000", "unix:/tmp/sock", ""],
)
def test_a_peer_on_this_host_may_advertise_loopback(peer: str) -> None:
    assert loopback_endpoint_problem(ar_spec(), peer) == ""  # the real check: loopback is local
    assert loopback_endpoint_problem(ar_spec(), "ipv4:10.77.7.1:40000", _local) == ""  # this host's LAN address


def test_a_peer_address_of_this_host_is_local() -> None:
    assert service.is_local_address(ipaddress.ip_address("127.0.0.1"))
    assert not service.is_local_address(ipaddress.ip_address("192.0.2.1"))  # TEST-NET-1: never ours


def test_register_replica_refuses_a_loopback_endpoint_from_a_remote_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        core = BrokerCore(None, journal_synchronous="OFF")
        server = grpc.aio.server()
        add_broker_servicer(core, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            dit = replica("dit-0", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
            # The test's peer is loopback: pretend it is another host.
            monkeypatch.setattr(service, "is_local_address", _remote)
            await expect_error(
                stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=TIMEOUT),
                grpc.StatusCode.INVALID_ARGUMENT, "LOOPBACK_ENDPOINT",
            )
            assert core.list_replicas() == []
            monkeypatch.setattr(service, "is_local_address", _local)
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=dit), timeout=TIMEOUT)
            assert [s.spec.replica_id for s in core.list_replicas()] == ["dit-0"]
        finally:
            await channel.close()
            await server.stop(0)
            core.close()

    run(body(), timeout=20)
