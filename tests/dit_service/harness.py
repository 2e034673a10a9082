"""What the DiT service tests drive: a config in tmp_path, a real broker, a DiT process, and an AR
writer the test controls (it registers as `ar-0`, arms tickets, packs a seeded prefix into
staging, writes it with a real transport and reports each write when the test says so)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
import yaml

from kvrelay import LAYOUT_VERSION, __version__
from kvrelay.models.dit import random_prefix
from kvrelay.models.presets import get_preset
from kvrelay.server import GRPC_OPTIONS, GrpcServer
from kvrelay.transfer.convert import (
    geometry_to_proto,
    outcome_to_report,
    region_from_proto,
    writes_from_proto,
)
from kvrelay.transfer.pack import pack_staging
from kvrelay.transfer.planner import RowSpec, staging_bytes
from kvrelay.transfer.transport import WriteOutcome, make_sender
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from tests.procs import metrics_port_of, start_service

PAGE_SIZE = 16
STAGING_BYTES = 16 << 20


def write_config(
    tmp_path: Path,
    *,
    transport: str = "mooncake",
    preset: str = "tiny",
    tp: int = 1,
    sp: int = 1,
    transfer_timeout: float = 5.0,
    max_num_seqs: int = 1,
    kv_cache_memory_bytes: int = 4 << 20,
    drain_quiet_seconds: float = 0.2,
    lease_seconds: float = 3.0,
    quantization: str | None = None,
    cfg_parallel: int = 1,
) -> Path:
    ar: dict[str, Any] = {
        "stage_id": 0, "kind": "ar", "devices": "cpu", "kv_cache_memory_bytes": 16 << 20, "port": 0,
        "metrics_port": 0, "model": {"preset": preset},
    }
    dit: dict[str, Any] = {
        "stage_id": 1, "kind": "dit", "devices": "cpu", "tensor_parallel_size": tp, "sequence_parallel_size": sp,
        "max_num_seqs": max_num_seqs, "kv_cache_memory_bytes": kv_cache_memory_bytes, "page_size": PAGE_SIZE,
        "port": 0, "metrics_port": 0, "request_timeout_seconds": 60, "model": {"preset": preset},
    }
    if cfg_parallel != 1:
        dit["cfg_parallel_size"] = cfg_parallel
    if quantization is not None:
        dit["model"]["quantization"] = quantization
    if transport == "mooncake":
        ar["kv_transfer_config"] = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                                    "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        dit["kv_transfer_config"] = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                                     "kv_connector_extra_config": {"mooncake_protocol": "tcp",
                                                                   "transfer_timeout": transfer_timeout}}
    elif transport == "grpc":
        # The fallback has no kv_transfer_config, so transfer_timeout is the default 60 s there.
        pass
    cfg = {
        "async_chunk": False,
        "broker": {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "journal_path": str(tmp_path / "broker.sqlite"),
                   "lease_seconds": lease_seconds, "drain_quiet_seconds": drain_quiet_seconds},
        "stages": [ar, dit],
        "edges": [{"from": 0, "to": 1}],
    }
    path = tmp_path / "kvrelay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ------------------------------------------------------------------------------------------------
# Broker: the real BrokerCore behind the real BrokerService servicer, on this test's event loop
# ------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def inprocess_broker(drain_quiet_seconds: float = 0.2, lease_seconds: float = 10.0, *,
                           journal_path: Path | None = None, port: int = 0,
                           servicer_class: type[Any] | None = None) -> AsyncIterator[Any]:
    """Journal-less by default; with `journal_path` and the first one's `port`, a second one is
    that broker restarted. `servicer_class`: a BrokerServicer subclass that injects a fault."""
    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.service import BrokerServicer
    from kvrelay.broker.waiters import run_maintenance

    core = BrokerCore(journal_path, lease_seconds=lease_seconds, drain_quiet_seconds=drain_quiet_seconds)
    name = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"].full_name
    server = GrpcServer(name="broker", host="127.0.0.1", port=port,
                        registrations=[(broker_pb2_grpc.add_BrokerServiceServicer_to_server,
                                        (servicer_class or BrokerServicer)(core), name)])
    await server.start()
    maintenance = asyncio.get_running_loop().create_task(run_maintenance(core, 0.05))
    try:
        yield server, core
    finally:
        maintenance.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await maintenance
        await server.stop(grace=0.5)
        core.close()


@contextlib.asynccontextmanager
async def broker_process(config: Path, cwd: Path) -> AsyncIterator[Any]:
    """`python -m kvrelay broker` with this config (its own journal in tmp_path), stopped after."""
    from tests.procs import start_service

    proc = await asyncio.to_thread(
        start_service, ["broker", "--config", str(config), "--port", "0", "--metrics-port", "0"], cwd=cwd
    )
    try:
        yield proc
    finally:
        await asyncio.to_thread(proc.stop)


# ------------------------------------------------------------------------------------------------
# DiT process
# ------------------------------------------------------------------------------------------------


@dataclass
class DitProcess:
    proc: subprocess.Popen[str]
    address: str
    lines: list[str]

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)

    def metrics_port(self) -> int | None:
        return metrics_port_of(self.lines)

    def pool_bytes(self, rank: int, offset: int, length: int, replica_id: str = "dit-0") -> bytes:
        """What the DiT's host pool of `rank` holds at `offset` now (read from its /dev/shm file,
        dit_service/memory.py): where a PutKv chunk lands, seen from outside the process."""
        from kvrelay.dit_service import memory

        (path,) = memory._SHM_DIR.glob(f"kvrelay-{replica_id}-{self.proc.pid}-rank{rank}-*")
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(length)


def start_dit(config: Path, broker_address: str, *, cwd: Path, timeout: float = 60.0) -> DitProcess:
    """`python -m kvrelay dit` with this config; returns once it printed its listening line. Every
    output line is kept (read on a thread) for failure messages."""
    args = ["dit", "--config", str(config), "--replica", "0", "--broker", broker_address]
    started = start_service(args, cwd=cwd, timeout=timeout)
    return DitProcess(started.proc, started.address, started.lines)


async def wait_serving(dit: DitProcess, timeout: float = 90.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(dit.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if dit.proc.poll() is not None:
                raise RuntimeError(f"DiT exited {dit.proc.returncode}:\n" + "".join(dit.lines[-30:]))
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"DiT at {dit.address} not SERVING after {timeout}s")


# ------------------------------------------------------------------------------------------------
# One broker and one DiT shared by the tests of a module
# ------------------------------------------------------------------------------------------------

T = TypeVar("T")


class SharedReplica:
    """An in-process broker and a `kvrelay dit` that the tests of a module share: for tests that
    only call the DiT's RPCs and end every ticket they make, never for one that stops, kills,
    fences or restarts the DiT or the broker, or needs a broker servicer of its own. A DiT's start
    (its rank process, torch, Mooncake) is most of such a test's time.

    The broker and every test's scenario (`run`) run on one event loop, on a thread of its own:
    the broker answers the DiT's heartbeats between tests too, and a scenario may use the core
    (`core.get_ticket`, `core.waiters`) as it would on its own loop. Started by the first test
    that uses it (within that test's Mooncake port window, tests/conftest.py). After each test
    (`test`), every page must be free and every ticket released with the DiT still running, or
    the pair is stopped (the next test starts a fresh one) and the test fails: no test sees what
    an earlier one left behind. The DiT's clean exit (0) is checked when the module ends."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.tmp_path = tmp_path
        self.config = write_config(tmp_path, **config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: contextlib.AbstractAsyncContextManager[Any] | None = None
        self.broker: Any = None
        self.core: Any = None
        self.dit: DitProcess | None = None
        # Index into dit.lines where the running test's lines start.
        self.first_line = 0
        # Every line of the DiTs stopped so far (a failed test's replica is replaced).
        self.all_lines: list[str] = []

    def run(self, scenario: Coroutine[Any, Any, T]) -> T:
        """Run `scenario` on the shared loop; returns its result or raises its exception."""
        assert self._loop is not None, "SharedReplica.run outside SharedReplica.test()"
        future = asyncio.run_coroutine_threadsafe(scenario, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # a timeout or an interrupt in this thread: the scenario stops too
            raise

    def test_lines(self) -> list[str]:
        """The DiT's output lines printed since the running test started."""
        assert self.dit is not None
        return self.dit.lines[self.first_line :]

    @contextlib.contextmanager
    def test(self) -> Iterator[SharedReplica]:
        if self.dit is None:
            self._start()
        assert self.dit is not None
        self.first_line = len(self.dit.lines)
        try:
            yield self
        except BaseException:
            self.stop()  # whatever the failed test left, the next one starts afresh
            raise
        leftover = self.run(self._leftover())
        if leftover:
            self.stop()
            raise AssertionError(f"the test left the shared DiT replica unclean: {leftover}")

    async def _leftover(self, timeout: float = 10.0) -> str:
        """'' once every page is free and every ticket released (drain quiet periods pass), else
        what is left."""
        from kvrelay.broker.tickets import TicketState

        assert self.dit is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.dit.proc.poll() is not None:
                return f"the DiT exited {self.dit.proc.returncode}:\n" + "".join(self.dit.lines[-30:])
            live = [t for t in self.core.list_tickets() if t.state is not TicketState.RELEASED]
            (pool,) = self.core.pool_status("dit-0")
            if not live and pool.free == pool.total and not pool.fenced:
                return ""
            if time.monotonic() > deadline:
                return f"tickets {[(t.ticket_id, t.state.name) for t in live]}, pool {pool}"
            await asyncio.sleep(0.05)

    def _start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shared-replica-loop", daemon=True)
        self._thread.start()
        self._broker = inprocess_broker()
        self.broker, self.core = self.run(self._broker.__aenter__())
        self.dit = start_dit(self.config, self.broker.address, cwd=self.tmp_path)
        self.run(wait_serving(self.dit))

    def stop(self) -> int | None:
        """Stop the DiT, then the broker and the loop; the DiT's exit code (None if none ran)."""
        code = None
        if self._loop is None:
            return code
        try:
            if self.dit is not None:
                # On the loop's executor: the DiT releases and deregisters with the broker on its way out.
                code = self.run(asyncio.to_thread(self.dit.stop))
        finally:
            if self.dit is not None:
                self.all_lines += self.dit.lines
            self.dit = None
            try:
                if self._broker is not None:
                    self.run(self._broker.__aexit__(None, None, None))
            finally:
                self._broker = None
                self.run(_end_of_loop())  # as asyncio.run ends its loop
                self._loop.call_soon_threadsafe(self._loop.stop)
                assert self._thread is not None
                self._thread.join(10)
                self._loop.close()
                self._loop = self._thread = None
        return code

    def __enter__(self) -> SharedReplica:
        return self

    def __exit__(self, *exc: object) -> None:
        lines = self.dit.lines[-30:] if self.dit is not None else []
        code = self.stop()
        assert code in (None, 0), f"the shared DiT exited {code}:\n" + "".join(lines)


async def _end_of_loop() -> None:
    """What asyncio.run does before it closes its loop: cancel what is left, close the async
    generators (a request stream a test left suspended), stop the default executor."""
    loop = asyncio.get_running_loop()
    left = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


# ------------------------------------------------------------------------------------------------
# The AR writer the test controls
# ------------------------------------------------------------------------------------------------


_STAGING: list[torch.Tensor] = []


def shared_staging() -> torch.Tensor:
    """The test process's one staging buffer, never freed. Mooncake's endpoint is one per process
    and keeps every registration: fresh tensors per write would reuse freed, still-registered
    addresses (register_memory then fails), so every test writer packs into views of this one."""
    if not _STAGING:
        from kvrelay.transfer.mooncake import endpoint

        buffer = torch.zeros(STAGING_BYTES, dtype=torch.uint8)
        endpoint().register(buffer)  # whole, up front: later slices are views of one registration
        _STAGING.append(buffer)
    return _STAGING[0]


class ArWriter:
    """Registers as ar-0 (TP=1) and plays the AR's part of the protocol, step by step."""

    def __init__(self, broker_address: str, preset: str, transport: str) -> None:
        self.preset = get_preset(preset)
        self.geometry = self.preset.kv_geometry(PAGE_SIZE)
        self.transport = transport
        self.channel = grpc.aio.insecure_channel(broker_address, options=GRPC_OPTIONS)
        self.stub = broker_pb2_grpc.BrokerServiceStub(self.channel)
        self.incarnation_id = str(uuid.uuid4())
        self.sender: Any = None
        self.staging = shared_staging()

    async def register(self) -> None:
        info = broker_pb2.ReplicaInfo(
            replica_id="ar-0", role=common_pb2.REPLICA_ROLE_AR, incarnation_id=self.incarnation_id,
            layout_version=LAYOUT_VERSION, version=__version__, endpoint="127.0.0.1:1",
            geometry=geometry_to_proto(self.geometry), parallelism=common_pb2.Parallelism(tensor_parallel_size=1),
            max_tokens=self.preset.ar.max_tokens, stage_id=0,
            transport=common_pb2.TRANSPORT_KIND_MOONCAKE if self.transport == "mooncake"
            else common_pb2.TRANSPORT_KIND_GRPC_STREAM,
        )
        await self.stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=info), timeout=5.0)

    async def create_ticket(self, token_counts: Sequence[int], request_id: str | None = None) -> broker_pb2.Ticket:
        # This writer sends no background heartbeats: renew the lease so the broker counts it up.
        await self.stub.Heartbeat(
            broker_pb2.HeartbeatRequest(replica_id="ar-0", incarnation_id=self.incarnation_id), timeout=5.0
        )
        reply = await self.stub.CreateTicket(
            broker_pb2.CreateTicketRequest(request_id=request_id or uuid.uuid4().hex, ar_replica_id="ar-0",
                                           dit_replica_id="dit-0", row_token_counts=list(token_counts)),
            timeout=5.0,
        )
        return reply.ticket

    async def arm(self, ticket_id: str) -> broker_pb2.ReserveTicketResponse:
        return await self.stub.ReserveTicket(
            broker_pb2.ReserveTicketRequest(ticket_id=ticket_id, ar_replica_id="ar-0",
                                            incarnation_id=self.incarnation_id),
            timeout=5.0,
        )

    def rows_kv(self, token_counts: Sequence[int], seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Seeded full prefixes (every kv head), one per row: what 'the AR' computed."""
        return [random_prefix(self.preset, n, seed + row) for row, n in enumerate(token_counts)]

    def write(self, armed: broker_pb2.ReserveTicketResponse, prefixes: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
              only: Sequence[tuple[int, int]] | None = None) -> list[WriteOutcome]:
        """Pack and send (blocking: call from a thread); `only` restricts to (row, dst_rank) writes."""
        writes = writes_from_proto(armed.writes)
        rows = [RowSpec(r.row, r.num_tokens, tuple(r.page_ids)) for r in armed.ticket.rows]
        need = staging_bytes(writes, 0)
        if need > self.staging.numel():
            raise ValueError(f"test staging buffer too small: {need} bytes needed")
        staging = self.staging[:need]
        staging.zero_()
        kv_by_row = {
            row: torch.stack([torch.stack([k, v]) for k, v in prefix]) for row, prefix in enumerate(prefixes)
        }
        dst_shards = max(w.dst_rank for w in writes) + 1
        pack_staging(staging, kv_by_row, self.geometry, 1, dst_shards, rows, writes, 0)
        chosen = [w for w in writes if only is None or (w.row, w.dst_rank) in only]
        destinations = {r.rank: region_from_proto(r) for r in armed.destinations}
        if self.sender is None:
            self.sender = make_sender(self.transport)
        return list(self.sender.write(staging, chosen, destinations, armed.ticket.ticket_id, 10.0))

    async def report(self, ticket_id: str, outcomes: Sequence[WriteOutcome]) -> broker_pb2.Ticket:
        ticket = None
        for o in outcomes:
            reply = await self.stub.ReportWrite(outcome_to_report(o, ticket_id, "ar-0", self.incarnation_id),
                                                timeout=5.0)
            ticket = reply.ticket
        assert ticket is not None
        return ticket

    async def written_ticket(self, token_counts: Sequence[int], *, seed: int) -> broker_pb2.Ticket:
        """A new ticket armed, written (`rows_kv(token_counts, seed)`) and every write reported: what
        an AR leaves behind before its DiT's Denoise call. Returns the ticket as created."""
        ticket = await self.create_ticket(token_counts)
        armed = await self.arm(ticket.ticket_id)
        await self.report(ticket.ticket_id, await asyncio.to_thread(self.write, armed, self.rows_kv(token_counts, seed)))
        return ticket

    async def pool(self) -> broker_pb2.PoolStatus:
        reply = await self.stub.GetPool(broker_pb2.GetPoolRequest(replica_id="dit-0"), timeout=5.0)
        return reply.pools[0]

    async def ticket(self, ticket_id: str) -> broker_pb2.Ticket:
        return (await self.stub.GetTicket(broker_pb2.GetTicketRequest(ticket_id=ticket_id), timeout=5.0)).ticket

    async def close(self) -> None:
        if self.sender is not None and self.transport == "grpc":
            self.sender.close()
        await self.channel.close()
