"""Broker throughput: full ticket lifecycles per second, in-process and over gRPC on loopback.

One lifecycle = CreateTicket (reserve + plan) -> ReserveTicket (arm) -> ReportWrite per planned
write -> ReportLoad per (row, dst_rank) -> CONSUMING -> ReleaseTicket, every transition committed
to the SQLite journal before it is revealed. The shape is the reference deployment's
(bagel-7b-shape KV geometry, AR TP=2 -> DiT TP=2, two CFG rows).

    .venv/bin/python benchmarks/broker_bench.py [--n 2000] [--grpc-n 1000] [--concurrency 8]

Not a test: it prints numbers; docs/broker.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import structlog

from kvrelay import LAYOUT_VERSION
from kvrelay.broker.core import BrokerCore
from kvrelay.broker.registry import MemoryRegionSpec, ReplicaRole, ReplicaSpec
from kvrelay.broker.service import add_broker_servicer
from kvrelay.broker.tickets import TicketOutcome, WriteStatus
from kvrelay.broker.waiters import run_maintenance
from kvrelay.security import Credentials, channel_options, server_options
from kvrelay.transfer.layout import KvGeometry
from kvrelay.v1 import broker_pb2, broker_pb2_grpc, common_pb2

GEOMETRY = KvGeometry(num_layers=28, num_kv_heads=4, head_dim=128, dtype="bfloat16", page_size=16)
ROWS = [300, 12]  # prompt row and the unconditional (negative) row
TP = 2


def specs() -> tuple[ReplicaSpec, ReplicaSpec]:
    common = dict(layout_version=LAYOUT_VERSION, version="bench", endpoint="127.0.0.1:1", geometry=GEOMETRY,
                  tensor_parallel_size=TP)
    ar = ReplicaSpec(replica_id="ar-0", role=ReplicaRole.AR, incarnation_id="ar-inc", max_tokens=4096,
                     **common)  # type: ignore[arg-type]
    dit = ReplicaSpec(
        replica_id="dit-0", role=ReplicaRole.DIT, incarnation_id="dit-inc", num_pages=4096,
        regions=tuple(MemoryRegionSpec(r, "mooncake", f"127.0.0.1:{9000 + r}", 0, 1 << 34) for r in range(TP)),
        **common,  # type: ignore[arg-type]
    )
    return ar, dit


def in_process(n: int, journal: Path | None, synchronous: str) -> float:
    core = BrokerCore(journal, lease_seconds=1e9, drain_quiet_seconds=0.0, journal_synchronous=synchronous)  # type: ignore[arg-type]
    ar, dit = specs()
    core.register_replica(ar)
    core.register_replica(dit)
    start = time.perf_counter()
    for i in range(n):
        t = core.create_ticket(f"r{i}", "ar-0", "dit-0", ROWS)
        assert t is not None
        arming = core.arm_ticket(t.ticket_id, "ar-0", "ar-inc")
        for w in arming.writes:
            core.report_write(t.ticket_id, _key(w), replica_id="ar-0", incarnation_id="ar-inc",
                              status=WriteStatus.OK, checksum=i, nbytes=w.num_bytes)
        for ld in t.loads:
            core.report_load(t.ticket_id, ld.key.row, ld.key.dst_rank, replica_id="dit-0", incarnation_id="dit-inc",
                             verified={_key(w): i for w in arming.writes
                                       if w.row == ld.key.row and w.dst_rank == ld.key.dst_rank})
        core.start_consuming(t.ticket_id)
        done = core.release_ticket(t.ticket_id, TicketOutcome.OK)
        assert done.state.value == "RELEASED"
    elapsed = time.perf_counter() - start
    core.close()
    return n / elapsed


def planner_only(n: int) -> float:
    """Plans per second of the same shape: the share of a lifecycle the pure planner takes."""
    from kvrelay.transfer.planner import RowSpec, plan_transfer

    rows, start_page = [], 0
    for i, tokens in enumerate(ROWS):
        pages = GEOMETRY.pages_for(tokens)
        rows.append(RowSpec(i, tokens, tuple(range(start_page, start_page + pages))))
        start_page += pages
    start = time.perf_counter()
    for _ in range(n):
        plan_transfer(GEOMETRY, TP, TP, rows)
    return n / (time.perf_counter() - start)


def _key(w):  # noqa: ANN001, ANN202
    from kvrelay.broker.tickets import WriteKey

    return WriteKey(w.row, w.src_rank, w.dst_rank)


def grpc_server() -> grpc.aio.Server:
    """A broker listener with every kvrelay server's options (kvrelay.security.server_options),
    keepalive ping permits included: the bench's channel pings as the broker's clients do (every
    15 s), and a plain server would tear a long run's idle connection down with GOAWAY
    too_many_pings."""
    return grpc.aio.server(options=server_options(Credentials()))


async def over_grpc(n: int, concurrency: int, journal: Path, synchronous: str) -> float:
    core = BrokerCore(journal, lease_seconds=1e9, drain_quiet_seconds=0.0, journal_synchronous=synchronous)  # type: ignore[arg-type]
    ar, dit = specs()
    core.register_replica(ar)
    core.register_replica(dit)
    server = grpc_server()
    add_broker_servicer(core, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    maintenance = asyncio.create_task(run_maintenance(core, 0.05))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    stub = broker_pb2_grpc.BrokerServiceStub(channel)

    async def lifecycle(i: int) -> None:
        t = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
            request_id=f"g{i}", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=ROWS),
            timeout=30)).ticket
        armed = await stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
            ticket_id=t.ticket_id, ar_replica_id="ar-0", incarnation_id="ar-inc"), timeout=30)
        await asyncio.gather(*(stub.ReportWrite(broker_pb2.ReportWriteRequest(
            ticket_id=t.ticket_id, row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, replica_id="ar-0",
            incarnation_id="ar-inc", status=common_pb2.WRITE_STATUS_OK, checksum=i), timeout=30)
            for w in armed.writes))
        await asyncio.gather(*(stub.ReportLoad(broker_pb2.ReportLoadRequest(
            ticket_id=t.ticket_id, row=ld.row, dst_rank=ld.dst_rank, replica_id="dit-0", incarnation_id="dit-inc",
            verified=[broker_pb2.WriteProgress(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, checksum=i)
                      for w in armed.writes if w.row == ld.row and w.dst_rank == ld.dst_rank]), timeout=30)
            for ld in t.loads))
        core.start_consuming(t.ticket_id)  # the orchestrator does this in-process
        done = await stub.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
            ticket_id=t.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0",
            incarnation_id="dit-inc"), timeout=30)
        assert done.ticket.state == broker_pb2.TICKET_STATE_RELEASED

    next_id = 0

    async def worker() -> None:
        nonlocal next_id
        while next_id < n:
            i = next_id
            next_id += 1
            await lifecycle(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    maintenance.cancel()
    await channel.close()
    await server.stop(None)
    core.close()
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="in-process lifecycles per journal mode")
    parser.add_argument("--grpc-n", type=int, default=1000, help="lifecycles over gRPC per setting")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    # Per-transition info logs would measure the console, not the broker.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    workdir = Path(tempfile.mkdtemp(prefix="kvrelay-broker-bench-"))
    try:
        print(f"shape: {GEOMETRY}, AR TP={TP} -> DiT TP={TP}, rows {ROWS} tokens")
        print(f"{'planner alone (plan_transfer), for reference':58s} {planner_only(args.n):10.0f} plans/s")
        for label, journal, sync in (
            ("in-process, journal :memory:", None, "OFF"),
            ("in-process, journal file synchronous=NORMAL", workdir / "normal.sqlite", "NORMAL"),
            ("in-process, journal file synchronous=FULL", workdir / "full.sqlite", "FULL"),
        ):
            print(f"{label:58s} {in_process(args.n, journal, sync):10.0f} lifecycles/s")
        for conc in (1, args.concurrency):
            for sync in ("NORMAL", "FULL"):
                rate = asyncio.run(over_grpc(args.grpc_n, conc, workdir / f"g{conc}{sync}.sqlite", sync))
                print(f"{f'gRPC loopback, concurrency {conc}, synchronous={sync}':58s} {rate:10.0f} lifecycles/s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
