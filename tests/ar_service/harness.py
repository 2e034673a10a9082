"""What the AR service tests drive: a config in tmp_path, a real AR process (`python -m kvrelay ar`),
the real broker (BrokerCore behind the BrokerService servicer, from tests/dit_service/harness.py),
and a receiver the test owns: page regions registered with a real transport (a Mooncake endpoint,
or a DitService.PutKv server for the gRPC fallback) and a DiT registration that describes them,
so the test can read back exactly the bytes the AR wrote."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
import yaml

from kvrelay import LAYOUT_VERSION, __version__
from kvrelay.models.presets import get_preset
from kvrelay.server import GRPC_OPTIONS, GrpcServer
from kvrelay.transfer.convert import geometry_to_proto, region_to_proto
from kvrelay.transfer.layout import PageLayout
from kvrelay.transfer.pack import read_row
from kvrelay.transfer.planner import RowSpec
from kvrelay.transfer.transport import make_receiver
from kvrelay.v1 import ar_pb2_grpc, broker_pb2, broker_pb2_grpc, common_pb2, dit_pb2, dit_pb2_grpc
from tests.procs import metrics_port_of, start_service

PAGE_SIZE = 16
# Regions registered with this process's one Mooncake engine stay registered for its lifetime (the
# engine has no per-buffer unregister here), so their memory must stay alive too.
_REGISTERED_REGIONS: list[torch.Tensor] = []


def write_config(
    tmp_path: Path,
    *,
    transport: str = "mooncake",
    preset: str = "tiny",
    ar_tp: int = 1,
    dit_tp: int = 1,
    transfer_timeout: float = 10.0,
    lease_seconds: float = 3.0,
    ar_memory: int = 8 << 20,
) -> Path:
    ar: dict[str, Any] = {
        "stage_id": 0, "kind": "ar", "devices": "cpu", "tensor_parallel_size": ar_tp,
        "kv_cache_memory_bytes": ar_memory, "port": 0, "metrics_port": 0, "request_timeout_seconds": 60,
        "model": {"preset": preset},
    }  # fmt: skip
    dit: dict[str, Any] = {
        "stage_id": 1, "kind": "dit", "devices": "cpu", "tensor_parallel_size": dit_tp,
        "kv_cache_memory_bytes": 4 << 20, "page_size": PAGE_SIZE, "port": 0, "metrics_port": 0,
        "model": {"preset": preset},
    }  # fmt: skip
    if transport == "mooncake":
        ar["kv_transfer_config"] = {
            "kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp", "transfer_timeout": transfer_timeout},
        }  # fmt: skip
        dit["kv_transfer_config"] = {
            "kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp", "transfer_timeout": transfer_timeout},
        }  # fmt: skip
    cfg = {
        "async_chunk": False,
        "broker": {
            "host": "127.0.0.1", "port": 0, "metrics_port": 0, "journal_path": str(tmp_path / "broker.sqlite"),
            "lease_seconds": lease_seconds, "drain_quiet_seconds": 0.2,
        },
        "stages": [ar, dit],
        "edges": [{"from": 0, "to": 1}],
    }  # fmt: skip
    path = tmp_path / "kvrelay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------------------------------------
# The AR process
# ------------------------------------------------------------------------------------------------


@dataclass
class ArProcess:
    proc: subprocess.Popen[str]
    address: str
    lines: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)

    def output(self) -> str:
        return "".join(self.lines[-60:])

    def metrics_port(self) -> int | None:
        return metrics_port_of(self.lines)


@contextlib.asynccontextmanager
async def broker_process(config: Path, *, cwd: Path) -> Any:
    """`python -m kvrelay broker` with this config; yields its address, stopped (SIGTERM) after."""
    from tests.procs import start_service

    broker = await asyncio.to_thread(start_service, ["broker", "--config", str(config)], cwd=cwd)
    try:
        yield broker.address
    finally:
        code = await asyncio.to_thread(broker.stop)
        assert code == 0, f"broker exited {code}"


def start_ar(
    config: Path, broker_address: str, *, cwd: Path, replica: int = 0, timeout: float = 60.0
) -> ArProcess:
    """`python -m kvrelay ar`; returns once it printed its listening line (output kept on a thread)."""
    args = ["ar", "--config", str(config), "--replica", str(replica), "--broker", broker_address]
    started = start_service(args, cwd=cwd, timeout=timeout)
    return ArProcess(started.proc, started.address, started.lines)


async def wait_serving(address: str, timeout: float = 90.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout}s")


def ar_stub(channel: grpc.aio.Channel) -> ar_pb2_grpc.ArServiceStub:
    return ar_pb2_grpc.ArServiceStub(channel)  # type: ignore[no-untyped-call]


# ------------------------------------------------------------------------------------------------
# The receiver: page regions + a DiT registration describing them
# ------------------------------------------------------------------------------------------------


class _PutKvServicer(dit_pb2_grpc.DitServiceServicer):
    """The receiving half of the gRPC fallback, as the DiT runs it: chunks into the regions."""

    def __init__(self, receiver: Any, delay_s: float = 0.0) -> None:
        self.receiver = receiver
        self.delay_s = delay_s

    async def PutKv(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> dit_pb2.PutKvResponse:
        # A slow receiver keeps a write in flight long enough for a test to cancel the request.
        await asyncio.sleep(self.delay_s)
        sink = self.receiver.sink()
        async for chunk in request_iterator:
            sink.apply(chunk)
        return sink.response()


class Receiver:
    """A DiT stand-in with `world_size` rank regions of `num_pages` pages each."""

    def __init__(
        self,
        broker_address: str,
        *,
        preset: str,
        transport: str,
        world_size: int,
        num_pages: int,
        put_delay_s: float = 0.0,
    ) -> None:
        self.put_delay_s = put_delay_s
        self.preset = get_preset(preset)
        self.geometry = self.preset.kv_geometry(PAGE_SIZE)
        self.transport = transport
        self.world_size = world_size
        self.num_pages = num_pages
        self.layouts = [PageLayout(self.geometry, world_size, r) for r in range(world_size)]
        # Non-zero fill: pages the AR writes must come back exactly, padding included.
        self.regions = [
            torch.full((lay.pool_bytes(num_pages),), 0xA5, dtype=torch.uint8) for lay in self.layouts
        ]
        self.channel = grpc.aio.insecure_channel(broker_address, options=GRPC_OPTIONS)
        self.stub = broker_pb2_grpc.BrokerServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.incarnation_id = uuid.uuid4().hex
        self.server: GrpcServer | None = None
        self._receiver: Any = None

    async def start(self) -> None:
        if self.transport == "mooncake":
            self._receiver = make_receiver("mooncake", hostname="127.0.0.1")
            _REGISTERED_REGIONS.extend(self.regions)
        else:
            self.server = GrpcServer(
                name="fake-dit",
                host="127.0.0.1",
                port=0,
                registrations=[
                    (
                        dit_pb2_grpc.add_DitServiceServicer_to_server,
                        _PutKvServicer(self, self.put_delay_s),
                        "kvrelay.v1.DitService",
                    )
                ],
            )
            await self.server.start()
            self._receiver = make_receiver("grpc", endpoint=self.server.address)
        descriptors = [self._receiver.register_region(buf, rank) for rank, buf in enumerate(self.regions)]
        info = broker_pb2.ReplicaInfo(
            replica_id="dit-0", role=common_pb2.REPLICA_ROLE_DIT, incarnation_id=self.incarnation_id,
            layout_version=LAYOUT_VERSION, version=__version__, endpoint="127.0.0.1:1",
            regions=[region_to_proto(d) for d in descriptors], geometry=geometry_to_proto(self.geometry),
            parallelism=common_pb2.Parallelism(tensor_parallel_size=self.world_size, sequence_parallel_size=1),
            num_pages=self.num_pages, stage_id=1,
            transport=common_pb2.TRANSPORT_KIND_MOONCAKE if self.transport == "mooncake"
            else common_pb2.TRANSPORT_KIND_GRPC_STREAM,
        )  # fmt: skip
        await self.stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info), timeout=5.0)

    def sink(self) -> Any:
        return self._receiver.sink()

    async def create_ticket(
        self, token_counts: Sequence[int], ar_replica_id: str = "ar-0"
    ) -> broker_pb2.Ticket:
        reply = await self.stub.CreateTicket(
            broker_pb2.CreateTicketRequest(
                request_id=uuid.uuid4().hex, ar_replica_id=ar_replica_id, dit_replica_id="dit-0",
                row_token_counts=list(token_counts),
            ),
            timeout=5.0,
        )  # fmt: skip
        return reply.ticket

    async def ticket(self, ticket_id: str) -> broker_pb2.Ticket:
        return (
            await self.stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=ticket_id), timeout=5.0)
        ).ticket

    async def pool(self) -> broker_pb2.PoolStatus:
        return (await self.stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-0"), timeout=5.0)).pools[0]

    def row(self, rank: int, spec: broker_pb2.Ticket | Any, row: int) -> torch.Tensor:
        """What rank `rank` holds of CFG row `row`: [layers, 2, heads_local, T, head_dim]."""
        r = next(r for r in spec.rows if r.row == row)
        return read_row(
            self.regions[rank], self.layouts[rank], RowSpec(r.row, r.num_tokens, tuple(r.page_ids))
        )

    def page_bytes(self, rank: int, page_ids: Sequence[int]) -> list[torch.Tensor]:
        size = self.layouts[rank].page_bytes
        return [self.regions[rank][p * size : (p + 1) * size] for p in page_ids]

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0.5)
        await self.channel.close()
