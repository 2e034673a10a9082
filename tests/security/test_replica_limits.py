"""Bounds on what a holder of the replica token can make the broker hold (docs/operations.md,
Security). The design trusts that token; these limits keep a leaked one, or a buggy replica, from
exhausting the broker. Each test fails without its bound.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvrelay.broker.authz import broker_checks
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import MAX_PAGES_PER_REPLICA, MAX_REPLICAS, MAX_TOTAL_PAGES, MemoryRegionSpec
from kvrelay.broker.service import (
    MAX_WATCH_STREAMS,
    MAX_WATCH_STREAMS_PER_REPLICA,
    BrokerServicer,
    EndpointProbe,
)
from kvrelay.broker.tickets import InvalidArgument, ResourceExhausted
from kvrelay.config import BrokerConfig
from kvrelay.errors import reason_of
from kvrelay.security import ChannelSecurity, make_channel
from kvrelay.server import GrpcServer
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.helpers import ManualClock, ar_spec, dit_spec, new_incarnation
from tests.broker.test_grpc import replica
from tests.security.harness import CREDENTIALS


def _core(path: Path | None, clock: ManualClock, **kw: int) -> BrokerCore:
    return BrokerCore(path, clock=clock, drain_quiet_seconds=0.01, journal_synchronous="NORMAL", **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ total pages across replicas


def test_the_config_defaults_are_the_registry_bounds() -> None:
    cfg = BrokerConfig()  # type: ignore[call-arg]
    assert (cfg.max_replicas, cfg.max_total_pages) == (MAX_REPLICAS, MAX_TOTAL_PAGES)
    # The default bound holds far less than the 2 GiB of 256 fake DiTs at the largest page count.
    assert MAX_TOTAL_PAGES < MAX_REPLICAS * MAX_PAGES_PER_REPLICA * 2 // 16


def test_fake_dit_replicas_at_the_largest_page_count_are_refused_beyond_the_page_budget() -> None:
    # Found by audit: 256 made-up DiT replicas registered at MAX_PAGES_PER_REPLICA pages and two CFG
    # groups, each under the per-replica bound, grew the broker by about 2 GiB of page states.
    clock = ManualClock()
    core = _core(None, clock, max_total_pages=3 * MAX_PAGES_PER_REPLICA)
    core.register_replica(dit_spec("dit-0", num_pages=MAX_PAGES_PER_REPLICA))
    core.register_replica(dit_spec("dit-1", num_pages=MAX_PAGES_PER_REPLICA))
    with pytest.raises(ResourceExhausted) as err:
        core.register_replica(dit_spec("dit-2", num_pages=MAX_PAGES_PER_REPLICA, cfg_parallel_size=2))
    assert (err.value.code, err.value.reason) == ("RESOURCE_EXHAUSTED", "PAGE_BUDGET_EXHAUSTED")
    assert "replica.num_pages" in err.value.message and "broker.max_total_pages" in err.value.message
    assert "dit-2" not in core.registry and core.registry.total_pages() == 2 * MAX_PAGES_PER_REPLICA
    core.register_replica(dit_spec("dit-2", num_pages=MAX_PAGES_PER_REPLICA))  # exactly the budget fits
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-3", num_pages=1))
    # AR replicas hold no pages: the page budget never refuses one.
    core.register_replica(ar_spec("ar-0"))


def test_the_page_budget_forgets_idle_replicas_but_never_one_that_holds_pages(tmp_path: Path) -> None:
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock, max_total_pages=200)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=64)
    core.register_replica(ar)
    core.register_replica(dit)
    ticket = core.create_ticket("req-1", ar.replica_id, dit.replica_id, [20])
    assert ticket is not None
    core.register_replica(dit_spec("dit-fake", num_pages=100))
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-new", num_pages=100))  # every one is up: none forgotten
    clock.advance(core.lease_seconds + 1)
    # Lapsed: the idle fake is forgotten to make room; dit-0 stays, its pages held by a live ticket.
    core.register_replica(dit_spec("dit-new", num_pages=100))
    assert sorted(r.spec.replica_id for r in core.registry) == ["ar-0", "dit-0", "dit-new"]
    assert core.get_ticket(ticket.ticket_id).dit_replica_id == "dit-0"
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-more", num_pages=64))  # dit-0 is never evicted
    # A new incarnation of a held replica with as many pages re-registers; one growing them is refused.
    clock.advance(core.lease_seconds + 1)
    core.register_replica(dit_spec("dit-new", num_pages=100, incarnation="second"))
    with pytest.raises(ResourceExhausted):
        core.register_replica(dit_spec("dit-new", num_pages=137, incarnation="third"))
    assert core.registry.get("dit-new").spec.incarnation_id == "second"


def test_a_journaled_replica_registers_again_under_a_lowered_budget(tmp_path: Path) -> None:
    # The budget never refuses a registration that does not grow what the broker holds: after a
    # restart with a smaller broker.max_total_pages, the replicas whose tickets it journaled (pages
    # that may be in doubt) still reconcile, and a new incarnation with as many pages still comes.
    clock = ManualClock()
    core = _core(tmp_path / "j.sqlite", clock)
    ar, dit = ar_spec("ar-0"), dit_spec("dit-0", num_pages=64)
    core.register_replica(ar)
    core.register_replica(dit)
    assert core.create_ticket("req-1", ar.replica_id, dit.replica_id, [20]) is not None
    core.journal.close()
    restored = _core(tmp_path / "j.sqlite", clock, max_total_pages=10)
    restored.register_replica(dit)  # same incarnation: reconciles
    restored.register_replica(ar)
    restored.register_replica(new_incarnation(dit))
    assert restored.registry.get("dit-0").up(clock())


# ------------------------------------------------------------------ WatchTicket streams


async def _watching_broker(
    tmp_path: Path, probe: EndpointProbe | None = None, **limits: int
) -> tuple[GrpcServer, BrokerServicer, str]:
    """A broker behind the real interceptor and ownership checks, with ar-0, dit-0 and one ticket."""
    core = BrokerCore(tmp_path / "j.sqlite", lease_seconds=600.0, journal_synchronous="NORMAL")
    core.register_replica(ar_spec("ar-0"))
    core.register_replica(dit_spec("dit-0"))
    ticket = core.create_ticket("req-1", "ar-0", "dit-0", [20])
    assert ticket is not None
    servicer = BrokerServicer(core, 60.0, probe, **limits)
    server = GrpcServer(
        name="broker", host="127.0.0.1", port=0, credentials=CREDENTIALS, checks=broker_checks(core),
        registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server, servicer, "kvrelay.v1.BrokerService")],
    )  # fmt: skip
    await server.start()
    return server, servicer, ticket.ticket_id


def test_watch_ticket_streams_are_bounded_per_replica_and_in_all(tmp_path: Path) -> None:
    # Found by audit: a holder of the replica token could open WatchTicket streams without bound,
    # each holding broker memory and a waiter in the core for as long as it liked.
    async def scenario() -> None:
        server, servicer, ticket_id = await _watching_broker(
            tmp_path, max_watch_streams=3, max_watch_streams_per_replica=2
        )
        channels = {
            rid: make_channel(server.address, ChannelSecurity(token=CREDENTIALS.replica_token, replica_id=rid))
            for rid in ("dit-0", "ar-0")
        }
        calls: list[grpc.aio.UnaryStreamCall] = []

        async def watch(rid: str) -> grpc.aio.UnaryStreamCall:
            call = broker_pb2_grpc.BrokerServiceStub(channels[rid]).WatchTicket(
                broker_pb2.WatchTicketRequest(ticket_id=ticket_id), timeout=30.0
            )
            calls.append(call)
            reply = await call.read()  # the ticket now: the stream is held
            assert reply.ticket.ticket_id == ticket_id
            return call

        async def refused(rid: str, limit: str) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watch(rid)
            assert reason_of(err.value)[:2] == ("RESOURCE_EXHAUSTED", "TOO_MANY_STREAMS")
            assert limit in (err.value.details() or "")

        try:
            first = await watch("dit-0")
            await watch("dit-0")
            await refused("dit-0", "at most 2 per replica")
            await watch("ar-0")  # another replica has streams of its own
            await refused("ar-0", "at most 3, broker.max_watch_streams)")  # but not beyond the broker's bound
            assert servicer.watch_streams.open_streams("dit-0") == 2
            first.cancel()  # an ended stream makes room
            for _ in range(200):
                if servicer.watch_streams.open_streams("dit-0") == 1:
                    break
                await asyncio.sleep(0.01)
            await watch("dit-0")
        finally:
            for call in calls:
                call.cancel()
            for channel in channels.values():
                await channel.close()
            await server.stop(0.5)
        assert servicer.watch_streams.open_streams("dit-0") == servicer.watch_streams.open_streams("ar-0") == 0

    asyncio.run(scenario())


def test_the_watch_stream_config_defaults_are_the_servicer_bounds() -> None:
    cfg = BrokerConfig()  # type: ignore[call-arg]
    assert (cfg.max_watch_streams, cfg.max_watch_streams_per_replica) == (
        MAX_WATCH_STREAMS, MAX_WATCH_STREAMS_PER_REPLICA
    )


# ------------------------------------------------------------------ string fields of a registration


def _long_fields() -> list[tuple[str, broker_pb2.ReplicaInfo]]:
    """(the field named, a DiT registration with only that field too long)."""
    cases: list[tuple[str, broker_pb2.ReplicaInfo]] = []

    def case(field: str) -> broker_pb2.ReplicaInfo:
        info = replica("dit-9", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
        cases.append((field, info))
        return info

    case("replica.endpoint").endpoint = "10.1.2.3:" + "9" * 1_000_000  # not loopback: the broker would dial it
    case("replica.version").version = "v" * 100_000
    case("replica.regions[0].endpoint").regions[0].endpoint = "10.1.2.3:" + "7" * 100_000
    case("replica.regions[0].ipc_handle").regions[0].ipc_handle = b"\x01" * 100_000
    many = case("replica.regions")
    many.regions.extend(common_pb2.MemoryRegion(rank=r, transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
                                                endpoint="127.0.0.1:7000") for r in range(1, 5000))  # fmt: skip
    return cases


def test_long_strings_in_a_registration_are_refused_naming_the_field(tmp_path: Path) -> None:
    # Found by audit: a registration's strings other than ids (endpoint, version, region endpoints
    # and handles) and its region count were bounded only by the request size: each is kept for as
    # long as the replica id is (memory, journal, every ListReplicas and ReserveTicket reply), and
    # the advertised endpoint was dialled before anything else was checked.
    dialled: list[int] = []

    async def probe(endpoint: str) -> str:
        dialled.append(len(endpoint))
        return ""

    async def scenario() -> None:
        server, servicer, _ = await _watching_broker(tmp_path, probe)
        channel = make_channel(server.address, ChannelSecurity(token=CREDENTIALS.replica_token, replica_id="dit-9"))
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        try:
            for field, info in _long_fields():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info), timeout=10.0)
                assert reason_of(err.value)[:2] == ("INVALID_ARGUMENT", "FIELD_TOO_LONG"), field
                assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()
            assert "dit-9" not in servicer.core.registry and dialled == []
            # The bounds leave room for any real endpoint: a 253-character DNS name and a port.
            ok = replica("dit-9", common_pb2.REPLICA_ROLE_DIT, num_pages=16)
            ok.endpoint = "a" * 253 + ":50061"
            ok.regions[0].endpoint = "b" * 253 + ":7000"
            await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=ok), timeout=10.0)
            assert servicer.core.registry.get("dit-9").spec.endpoint == ok.endpoint and dialled == [len(ok.endpoint)]
        finally:
            await channel.close()
            await server.stop(0.5)

    asyncio.run(scenario())


def test_an_ar_registering_regions_is_refused_and_nothing_is_kept() -> None:
    # Found by audit: an AR's regions were never validated (they are a DiT's receive memory), so a
    # holder of the replica token kept up to MAX_REGIONS regions of 1.5 KB per AR replica id in the
    # broker's memory, journal and ListReplicas replies, read by nothing.
    core = _core(None, ManualClock())
    regions = tuple(MemoryRegionSpec(r, "mooncake", "127.0.0.1:7000", 0, 1 << 20, b"\x01" * 1024) for r in range(40))
    with pytest.raises(InvalidArgument) as err:
        core.register_replica(ar_spec("ar-9", regions=regions))
    assert (err.value.reason, "ar-9" in core.registry) == ("UNEXPECTED_REGIONS", False)
    assert "replica.regions: 40 regions" in err.value.message
    core.register_replica(ar_spec("ar-9"))  # as a real AR registers: no regions
