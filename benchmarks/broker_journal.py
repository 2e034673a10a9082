"""The broker's journal commits and its event loop: per-commit fsync vs group commit, side by side.

A broker process (BrokerCore + BrokerServicer on gRPC loopback, journal file at
`synchronous=FULL`, as `kvrelay broker` runs it) is driven through full request lifecycles by
concurrent clients making the RPCs the AR and the DiT make (CreateTicket, ReserveTicket, one
batched ReportWrite, one batched ReportLoad, StartConsuming, ReleaseTicket: six journaled
transitions; a served request adds the generation's row), bagel-7b-shaped geometry, AR TP=2 -> DiT
TP=2. Meanwhile a probe makes an unrelated RPC every few milliseconds: a Heartbeat of a replica
with no tickets (through the broker's servicer; in group mode it waits for the journal commits
behind what it shows, none here, where before it waited for every commit queued when it read the
core) and then a grpc.health Check (the event loop alone). `hb-health` is the Heartbeat's time
minus the Check's right after it, per probe: what the Heartbeat costs beyond a turn of the loop.

Modes, run alternately in one invocation, each in a fresh broker process:
- `per-commit`: `journal_group_commit=False`: every commit writes and fsyncs its own transaction
  on the event loop before the core method returns (the broker before group commit);
- `group`: `journal_group_commit=True` (`kvrelay broker` now): the loop only encodes and queues
  the commit; the journal's writer thread writes every queued commit in one transaction (one
  fsync); each reply awaits its record.

Per request it reports journal commits, SQLite transactions and fsync/fdatasync calls (counted
with strace in one extra, shorter run per mode, when strace is on the PATH), the event loop's
time spent inside `Journal.commit`, throughput, and the probe's latency p50/p99.

    .venv/bin/python benchmarks/broker_journal.py [--requests 400] [--concurrency 16] [--runs 2]

Not a test: it prints numbers; benchmarks/README.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kvrelay.suggest import SuggestingArgumentParser

MODES = ("per-commit", "group")


# ------------------------------------------------------------------ the broker process


def run_broker(journal: str, mode: str, synchronous: str) -> None:
    """The child: a broker on loopback; prints its port, serves until a line on stdin, then
    prints its journal's counters as JSON."""
    import structlog
    from grpc_health.v1 import health, health_pb2_grpc

    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.service import add_broker_servicer
    from kvrelay.broker.waiters import run_maintenance
    from kvrelay.security import Credentials, server_options

    # Per-transition info logs would measure the console, not the broker.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def main() -> None:
        core = BrokerCore(journal, lease_seconds=1e9, drain_quiet_seconds=0.0, journal_synchronous=synchronous,  # type: ignore[arg-type]
                          journal_group_commit=mode == "group")  # fmt: skip
        server = grpc.aio.server(options=server_options(Credentials()))
        add_broker_servicer(core, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        maintenance = asyncio.create_task(run_maintenance(core, 0.25))
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        s = core.journal.stats
        print(json.dumps({"commits": s.commits, "transactions": s.transactions, "caller_seconds": s.caller_seconds,
                          "writer_seconds": s.writer_seconds, "largest_group": s.largest_group}), flush=True)
        maintenance.cancel()
        await server.stop(None)
        core.close()

    asyncio.run(main())


# ------------------------------------------------------------------ the clients


def _geometry() -> Any:
    from kvrelay.v1 import common_pb2

    return common_pb2.KvGeometry(num_layers=28, num_kv_heads=4, head_dim=128, dtype=common_pb2.DTYPE_BFLOAT16,
                                 page_size=16)  # fmt: skip


def _replica(replica_id: str, dit: bool) -> Any:
    from kvrelay import LAYOUT_VERSION
    from kvrelay.v1 import broker_pb2, common_pb2

    return broker_pb2.ReplicaInfo(
        replica_id=replica_id, incarnation_id=f"{replica_id}-inc", layout_version=LAYOUT_VERSION, version="bench",
        role=common_pb2.REPLICA_ROLE_DIT if dit else common_pb2.REPLICA_ROLE_AR, endpoint="127.0.0.1:1",
        geometry=_geometry(), parallelism=common_pb2.Parallelism(tensor_parallel_size=2, sequence_parallel_size=1),
        regions=[common_pb2.MemoryRegion(rank=r, transport=common_pb2.TRANSPORT_KIND_MOONCAKE,
                                         endpoint=f"127.0.0.1:{9000 + r}", base_address=0, length=1 << 34)
                 for r in range(2 if dit else 0)],
        num_pages=1 << 16 if dit else 0, max_tokens=4096,
    )  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def lifecycle(stub: Any, i: int) -> None:
    """One request's broker RPCs, as the AR and the DiT make them: six journaled transitions."""
    from kvrelay.v1 import broker_pb2, common_pb2

    t = (await stub.CreateTicket(broker_pb2.CreateTicketRequest(
        request_id=f"r{i}", ar_replica_id="ar-0", dit_replica_id="dit-0", row_token_counts=[300, 12]),
        timeout=60)).ticket
    armed = await stub.ReserveTicket(broker_pb2.ReserveTicketRequest(
        ticket_id=t.ticket_id, ar_replica_id="ar-0", incarnation_id="ar-0-inc"), timeout=60)
    await stub.ReportWrite(broker_pb2.ReportWriteRequest(
        ticket_id=t.ticket_id, replica_id="ar-0", incarnation_id="ar-0-inc",
        writes=[broker_pb2.WriteReport(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                                       status=common_pb2.WRITE_STATUS_OK, checksum=i) for w in armed.writes]),
        timeout=60)
    await stub.ReportLoad(broker_pb2.ReportLoadRequest(
        ticket_id=t.ticket_id, replica_id="dit-0", incarnation_id="dit-0-inc",
        loads=[broker_pb2.LoadReport(row=ld.row, dst_rank=ld.dst_rank, verified=[
            broker_pb2.WriteProgress(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank, checksum=i)
            for w in armed.writes if w.row == ld.row and w.dst_rank == ld.dst_rank]) for ld in t.loads]),
        timeout=60)
    await stub.StartConsuming(broker_pb2.StartConsumingRequest(
        ticket_id=t.ticket_id, replica_id="dit-0", incarnation_id="dit-0-inc"), timeout=60)
    done = await stub.ReleaseTicket(broker_pb2.ReleaseTicketRequest(
        ticket_id=t.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0",
        incarnation_id="dit-0-inc"), timeout=60)
    assert done.ticket.state == broker_pb2.TICKET_STATE_RELEASED


async def drive(port: int, requests: int, concurrency: int, probe_interval: float) -> dict[str, Any]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvrelay.security import channel_options
    from kvrelay.v1 import broker_pb2, broker_pb2_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    probe_channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    stub = broker_pb2_grpc.BrokerServiceStub(channel)
    probe_stub = broker_pb2_grpc.BrokerServiceStub(probe_channel)
    health_stub = health_pb2_grpc.HealthStub(probe_channel)
    for rid, dit in (("ar-0", False), ("dit-0", True), ("ar-probe", False)):
        await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=_replica(rid, dit)), timeout=30)

    next_id = 0

    async def worker() -> None:
        nonlocal next_id
        while next_id < requests:
            i = next_id
            next_id += 1
            await lifecycle(stub, i)

    heartbeat_ms: list[float] = []
    health_ms: list[float] = []
    excess_ms: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await probe_stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id="ar-probe", incarnation_id="ar-probe-inc"),
                                       timeout=60)  # fmt: skip
            t1 = time.perf_counter()
            await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=60)
            t2 = time.perf_counter()
            heartbeat_ms.append((t1 - t0) * 1000)
            health_ms.append((t2 - t1) * 1000)
            excess_ms.append((t1 - t0 - (t2 - t1)) * 1000)
            await asyncio.sleep(probe_interval)

    probing = asyncio.create_task(probe())
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    stop.set()
    await probing
    await channel.close()
    await probe_channel.close()
    return {"elapsed": elapsed, "heartbeat_ms": heartbeat_ms, "health_ms": health_ms, "excess_ms": excess_ms}


def one_run(workdir: Path, mode: str, n: int, args: argparse.Namespace, strace: str | None = None) -> dict[str, Any]:
    journal = workdir / f"{mode}-{n}-{time.monotonic_ns()}.sqlite"
    cmd = [sys.executable, __file__, "--child", str(journal), mode, args.synchronous]
    trace = None
    if strace:
        trace = workdir / f"{journal.name}.strace"
        cmd = [strace, "-f", "--seccomp-bpf", "-c", "-e", "trace=fsync,fdatasync", "-o", str(trace), *cmd]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        port = int(child.stdout.readline())
        got = asyncio.run(drive(port, n, args.concurrency, args.probe_interval))
        child.stdin.write("stop\n")
        child.stdin.flush()
        got.update(json.loads(child.stdout.readline()))
    finally:
        child.stdin.close()
        child.wait(60)
    if trace is not None:
        calls = re.findall(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(fsync|fdatasync)$", trace.read_text(), re.M)
        got["fsyncs"] = sum(int(c) for c, _ in calls)
    got["requests"] = n
    return got


def main() -> None:
    parser = SuggestingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="lifecycles per run")
    parser.add_argument("--concurrency", type=int, default=16, help="lifecycles in flight")
    parser.add_argument("--runs", type=int, default=2, help="runs per mode, alternating")
    parser.add_argument("--probe-interval", type=float, default=0.005, help="seconds between probes")
    parser.add_argument("--synchronous", default="FULL", choices=["FULL", "NORMAL"])
    parser.add_argument("--fsync-requests", type=int, default=100, help="lifecycles of the strace'd run (0: none)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_broker(*args.child)
        return

    workdir = Path(tempfile.mkdtemp(prefix="kvrelay-journal-bench-", dir=os.environ.get("BENCH_DIR")))
    try:
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for run in range(args.runs):
            for mode in MODES:
                r = one_run(workdir, mode, args.requests, args)
                results[mode].append(r)
                print(f"run {run + 1} {mode:10s} {args.requests / r['elapsed']:7.1f} req/s", flush=True)
        # fsync + fdatasync calls per SQLite transaction, from a strace'd run (tracing slows each
        # sync, so that run groups differently: its own transactions are the denominator).
        per_txn: dict[str, tuple[float, float, float]] = {}
        strace = shutil.which("strace")
        if strace and args.fsync_requests:
            for mode in MODES:
                r = one_run(workdir, mode, args.fsync_requests, args, strace)
                # Setup (3 registrations, the journal's creation) counted out: a run of 0 requests.
                base = one_run(workdir, mode, 0, args, strace)
                syncs, txns = r["fsyncs"] - base["fsyncs"], r["transactions"] - base["transactions"]
                per_txn[mode] = (syncs / args.fsync_requests, txns / args.fsync_requests, syncs / max(1, txns))

        print(f"\njournal {args.synchronous}, {args.requests} lifecycles x {args.runs} runs per mode, "
              f"concurrency {args.concurrency}, probe every {args.probe_interval * 1000:g} ms")  # fmt: skip
        header = (f"{'mode':10s} {'req/s':>14s} {'commits/req':>11s} {'txns/req':>8s} {'fsyncs/req':>10s} "
                  f"{'loop ms/req in commit':>21s} {'heartbeat p50/p99 ms':>21s} {'health p50/p99 ms':>18s} "
                  f"{'hb-health p50/p99 ms':>20s}")  # fmt: skip
        print(header)
        summary: dict[str, dict[str, float]] = {}
        for mode in MODES:
            rs = results[mode]
            n = sum(r["requests"] for r in rs)
            rates = [r["requests"] / r["elapsed"] for r in rs]
            hb = [v for r in rs for v in r["heartbeat_ms"]]
            hc = [v for r in rs for v in r["health_ms"]]
            ex = [v for r in rs for v in r["excess_ms"]]
            # The three registrations' commits are in the counters too; negligible against n.
            s = {
                "rate": statistics.mean(rates), "spread": (max(rates) - min(rates)) / 2,
                "commits": sum(r["commits"] for r in rs) / n, "txns": sum(r["transactions"] for r in rs) / n,
                "loop_ms": sum(r["caller_seconds"] for r in rs) * 1000 / n,
                "hb50": _pct(hb, 0.5), "hb99": _pct(hb, 0.99), "hc50": _pct(hc, 0.5), "hc99": _pct(hc, 0.99),
                "ex50": _pct(ex, 0.5), "ex99": _pct(ex, 0.99),
                "group": max(r["largest_group"] for r in rs),
            }  # fmt: skip
            summary[mode] = s
            fs = f"{s['txns'] * per_txn[mode][2]:10.2f}" if mode in per_txn else f"{'-':>10s}"
            print(f"{mode:10s} {s['rate']:8.1f} ±{s['spread']:4.1f} {s['commits']:11.2f} {s['txns']:8.2f} {fs} "
                  f"{s['loop_ms']:21.3f} {s['hb50']:10.2f}/{s['hb99']:<10.2f} {s['hc50']:8.2f}/{s['hc99']:<9.2f} "
                  f"{s['ex50']:9.2f}/{s['ex99']:<10.2f}")  # fmt: skip
        for mode, (syncs, txns, ratio) in per_txn.items():
            print(f"strace'd run, {mode}: {syncs:.2f} fsync+fdatasync and {txns:.2f} transactions per request "
                  f"({ratio:.2f} per transaction; fsyncs/req above = txns/req x this)")  # fmt: skip
        a, b = summary["per-commit"], summary["group"]
        print(f"\ngroup / per-commit: throughput {b['rate'] / a['rate']:.2f}x, loop time in commits "
              f"{b['loop_ms'] / a['loop_ms']:.3f}x, transactions per request {b['txns'] / a['txns']:.2f}x, "
              f"heartbeat p99 {b['hb99'] / a['hb99']:.2f}x, health p99 {b['hc99'] / a['hc99']:.2f}x; "
              f"largest group {b['group']:.0f} commits in one transaction")  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
