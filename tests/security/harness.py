"""A deployment with every credential set, in-process on real sockets (port 0): the broker's real
BrokerService and GenerationService (BrokerCore, Orchestrator), an AR and a DiT server with their
real servicers (not attached to workers), all behind kvrelay.server.GrpcServer, so the shared
interceptor and the broker's ownership checks run exactly as in `kvrelay broker/ar/dit`.

The servers run on their own event loop thread; tests talk to them with blocking channels.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvrelay.security import CallerClass, ChannelSecurity, Credentials, make_sync_channel
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.broker.test_grpc import replica

REPO = Path(__file__).resolve().parents[2]
API, REPLICA, OPERATOR = "api-token-0123", "replica-token-4567", "operator-token-89ab"
CREDENTIALS = Credentials(api_token=API, replica_token=REPLICA, operator_token=OPERATOR,
                          rate_limit_per_second=0.0)  # fmt: skip
VICTIMS = ("ar-0", "dit-0")
WRONG_REPLICA = "ar-1"


class SecuredDeployment:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.addresses: dict[str, str] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="secured-deployment", daemon=True)
        self._stop: asyncio.Event | None = None
        self._done: Future[None] = Future()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SecuredDeployment:
        self._thread.start()
        started: Future[None] = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)  # type: ignore[assignment]
        self._serving = started
        ready = asyncio.run_coroutine_threadsafe(self._wait_ready(), self._loop)
        ready.result(timeout=60)
        self._register_replicas()
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._serving.result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _wait_ready(self) -> None:
        while len(self.addresses) < 3:
            if self._serving.done():
                self._serving.result()
            await asyncio.sleep(0.01)

    async def _serve(self) -> None:
        from prometheus_client import CollectorRegistry

        from kvrelay.ar_service.service import ArMetrics, ArServicer
        from kvrelay.broker.authz import broker_checks
        from kvrelay.broker.core import BrokerCore
        from kvrelay.broker.generation import GenerationServicer
        from kvrelay.broker.orchestrator import Orchestrator
        from kvrelay.broker.service import BrokerServicer
        from kvrelay.broker.waiters import run_maintenance
        from kvrelay.config import parse_config
        from kvrelay.dit_service.service import DitServicer
        from kvrelay.server import GrpcServer
        from kvrelay.v1 import ar_pb2_grpc, dit_pb2_grpc, generation_pb2_grpc

        self._stop = asyncio.Event()
        data = yaml.safe_load((REPO / "tests/configs/test-fast.yaml").read_text())
        cfg = parse_config(data, "secured")
        core = BrokerCore(self.tmp / "journal.sqlite", lease_seconds=600.0, drain_quiet_seconds=0.05)
        orchestrator = Orchestrator(core, cfg, CollectorRegistry(), credentials=CREDENTIALS)
        self.core = core
        broker = GrpcServer(
            name="broker", host="127.0.0.1", port=0, credentials=CREDENTIALS, checks=broker_checks(core),
            registrations=[
                (broker_pb2_grpc.add_BrokerServiceServicer_to_server, BrokerServicer(core, 5.0),
                 "kvrelay.v1.BrokerService"),
                (generation_pb2_grpc.add_GenerationServiceServicer_to_server, GenerationServicer(orchestrator),
                 "kvrelay.v1.GenerationService"),
            ],
        )  # fmt: skip
        ar = GrpcServer(
            name="ar-0", host="127.0.0.1", port=0, credentials=CREDENTIALS,
            registrations=[(ar_pb2_grpc.add_ArServiceServicer_to_server,
                            ArServicer(None, ArMetrics.create(CollectorRegistry()), lambda reason: None),
                            "kvrelay.v1.ArService")],
        )  # fmt: skip
        dit = GrpcServer(
            name="dit-0", host="127.0.0.1", port=0, credentials=CREDENTIALS,
            registrations=[(dit_pb2_grpc.add_DitServiceServicer_to_server, DitServicer(), "kvrelay.v1.DitService")],
        )  # fmt: skip
        maintenance = asyncio.create_task(run_maintenance(core, 0.05))
        servers = {"broker": broker, "ar": ar, "dit": dit}
        try:
            for server in servers.values():
                await server.start()
                await server.set_serving(True)
            await orchestrator.start()
            for name, server in servers.items():
                self.addresses[name] = server.address
            await self._stop.wait()
        finally:
            await orchestrator.stop()
            for server in servers.values():
                await server.stop(0.5)
            maintenance.cancel()
            core.close()

    # -- callers ---------------------------------------------------------------------------------

    @contextmanager
    def channel(self, server: str, security: ChannelSecurity | None) -> Iterator[grpc.Channel]:
        with make_sync_channel(self.addresses[server], security) as channel:
            yield channel

    def operator(self) -> broker_pb2_grpc.BrokerServiceStub:
        channel = make_sync_channel(self.addresses["broker"], CREDENTIALS.channel(CallerClass.OPERATOR))
        return broker_pb2_grpc.BrokerServiceStub(channel)  # type: ignore[no-untyped-call]

    def _register_replicas(self) -> None:
        for replica_id, role, pages in (("ar-0", common_pb2.REPLICA_ROLE_AR, 0),
                                        ("dit-0", common_pb2.REPLICA_ROLE_DIT, 64),
                                        (WRONG_REPLICA, common_pb2.REPLICA_ROLE_AR, 0)):  # fmt: skip
            with self.channel("broker", CREDENTIALS.channel(CallerClass.REPLICA, replica_id)) as ch:
                stub = broker_pb2_grpc.BrokerServiceStub(ch)  # type: ignore[no-untyped-call]
                stub.RegisterReplica(
                    broker_pb2.RegisterReplicaRequest(replica=replica(replica_id, role, num_pages=pages)), timeout=10
                )

    def snapshot(self) -> dict[str, Any]:
        """What no hostile caller may change: the victims' registrations, pools and tickets."""
        stub = self.operator()
        replicas = stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=10).replicas
        pools = stub.GetPool(broker_pb2.GetPoolRequest(), timeout=10).pools
        tickets = stub.ListTickets(broker_pb2.ListTicketsRequest(), timeout=10).tickets
        return {
            "replicas": sorted(
                (r.replica_id, r.incarnation_id, r.role, r.up, r.fenced, r.endpoint, r.num_pages)
                for r in replicas
                if r.replica_id in VICTIMS
            ),
            "pools": sorted(
                (p.replica_id, p.total_pages, p.free_pages, p.reserved_pages, p.draining_pages, p.fenced)
                for p in pools
                if p.replica_id in VICTIMS
            ),
            "tickets": sorted(t.ticket_id for t in tickets),
        }


@contextmanager
def secured_deployment(tmp: Path) -> Iterator[SecuredDeployment]:
    deployment = SecuredDeployment(tmp).start()
    try:
        yield deployment
    finally:
        deployment.stop()
