"""The broker's event loop while a journal compaction pass runs under RPC load, side by side with
the same load and no compaction.

A broker process (BrokerCore + BrokerServicer on gRPC loopback, group commit, journal at
`synchronous=FULL`, as `kvrelay broker` runs it) starts over a journal holding N finished
generations (a PNG of B bytes each) and a GenerationStore over it, as the orchestrator's. Clients
drive full ticket lifecycles through it (the RPCs the AR and the DiT make; benchmarks/
broker_journal.py's `lifecycle`) while a probe makes a Heartbeat then a grpc.health Check every
few ms. After a warm-up, one of two windows, runs alternating, each in a fresh broker process:

- `compaction`: the store's clock jumps past retention and one `JournalCompactor.compact_once()`
  runs on the broker's loop: N rows deleted in batches, the pages given back, the WAL truncated;
- `idle`: the same load for as long as the last compaction window took, nothing else.

Inside the window it reports the compaction's step count and step durations (each step is one
transaction or checkpoint on the loop: how long an RPC could wait for it), the loop's lag (a task
sleeping 1 ms, its overshoot), the probe's latency p50/p99, lifecycles per second, RPC failures,
and the ratios compaction / idle. This is where the timing the unit test
(tests/broker/test_journal_compaction.py) used to assert now lives.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/journal_compaction.py [--rows 2000] [--png-bytes 10000] [--runs 3]

Not a test: it prints numbers; benchmarks/README.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvrelay.suggest import SuggestingArgumentParser

sys.path.insert(0, str(Path(__file__).parent))
from broker_journal import _pct, _replica, lifecycle  # noqa: E402

_T = TypeVar("_T")
TTL_SECONDS = 600.0
MODES = ("compaction", "idle")


# ------------------------------------------------------------------ the broker process


def seed_journal(path: str, rows: int, png_bytes: int) -> None:
    from kvrelay.broker.generations import GenerationParams, GenerationStore, GenState, ImageResult
    from kvrelay.broker.journal import Journal

    journal = Journal(path, "OFF")
    store = GenerationStore(result_ttl_seconds=TTL_SECONDS, max_results=10 * rows, journal=journal)
    for n in range(rows):
        record, _ = store.create_or_attach(f"seed-{n}", GenerationParams("a cat", "", n, 64, 64, 1, 1.0), True)
        store.update(record, GenState.SUCCEEDED, image=ImageResult(os.urandom(png_bytes), 64, 64, n))
        store.persist(record)
    journal.close()


def run_broker(journal: str, rows: int, png_bytes: int, synchronous: str) -> None:
    """The child: a broker on loopback over a journal of `rows` generations; prints its port, then
    answers `compact` or `idle SECONDS` on stdin with one JSON line about that window; `stop`."""
    import structlog
    from grpc_health.v1 import health, health_pb2_grpc

    from kvrelay.broker.compaction import JournalCompactor
    from kvrelay.broker.core import BrokerCore
    from kvrelay.broker.generations import GenerationStore
    from kvrelay.broker.service import add_broker_servicer
    from kvrelay.broker.waiters import run_maintenance
    from kvrelay.security import Credentials, server_options

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    seed_journal(journal, rows, png_bytes)

    class TimedCompactor(JournalCompactor):
        """Records every step's own duration (the base class keeps only the longest)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.step_ms: list[float] = []

        async def _step(self, step: Callable[[], _T]) -> _T:
            def timed() -> _T:
                t0 = time.perf_counter()
                try:
                    return step()
                finally:
                    self.step_ms.append((time.perf_counter() - t0) * 1000)

            return await super()._step(timed)

    async def main() -> None:
        core = BrokerCore(journal, lease_seconds=1e9, drain_quiet_seconds=0.0, journal_synchronous=synchronous,  # type: ignore[arg-type]
                          journal_group_commit=True)  # fmt: skip
        offset = [0.0]
        store = GenerationStore(result_ttl_seconds=TTL_SECONDS, max_results=10 * rows, journal=core.journal,
                                clock=lambda: time.monotonic() + offset[0])  # fmt: skip
        assert store.restore() == rows
        compactor = TimedCompactor(core.journal, store)
        server = grpc.aio.server(options=server_options(Credentials()))
        add_broker_servicer(core, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        maintenance = asyncio.create_task(run_maintenance(core, 0.25))
        lags: list[tuple[float, float]] = []

        async def monitor() -> None:
            while True:
                t0 = time.monotonic()
                await asyncio.sleep(0.001)
                lags.append((t0, (time.monotonic() - t0 - 0.001) * 1000))

        monitoring = asyncio.create_task(monitor())
        print(port, flush=True)
        loop = asyncio.get_running_loop()
        while (line := (await loop.run_in_executor(None, sys.stdin.readline)).split()) and line[0] != "stop":
            t0 = time.monotonic()
            got: dict[str, Any] = {}
            if line[0] == "compact":
                offset[0] += TTL_SECONDS + 1
                size_before = core.journal.size_bytes()
                result = await compactor.compact_once()
                got = {"steps": result.steps, "rows_deleted": compactor.rows_deleted, "step_ms": compactor.step_ms,
                       "size_before": size_before, "size_after": result.size_bytes}  # fmt: skip
            else:
                await asyncio.sleep(float(line[1]))
            t1 = time.monotonic()
            got.update(t0=t0, t1=t1, lag_ms=[lag for t, lag in lags if t0 <= t <= t1])
            print(json.dumps(got), flush=True)
        monitoring.cancel()
        maintenance.cancel()
        await server.stop(None)
        core.close()

    asyncio.run(main())


# ------------------------------------------------------------------ the clients


async def drive(child: subprocess.Popen[str], port: int, command: str, args: argparse.Namespace) -> dict[str, Any]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvrelay.security import channel_options
    from kvrelay.v1 import broker_pb2, broker_pb2_grpc

    assert child.stdin is not None and child.stdout is not None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    probe_channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    stub = broker_pb2_grpc.BrokerServiceStub(channel)
    probe_stub = broker_pb2_grpc.BrokerServiceStub(probe_channel)
    health_stub = health_pb2_grpc.HealthStub(probe_channel)
    for rid, dit in (("ar-0", False), ("dit-0", True), ("ar-probe", False)):
        await stub.RegisterReplica(broker_pb2.RegisterReplicaRequest(replica=_replica(rid, dit)), timeout=30)

    stop = asyncio.Event()
    ended: list[float] = []  # when each lifecycle finished (monotonic)
    probes: list[tuple[float, float, float]] = []  # (start, heartbeat ms, health ms)
    failures: list[str] = []
    next_id = [0]

    async def worker() -> None:
        while not stop.is_set():
            next_id[0] += 1
            try:
                await lifecycle(stub, next_id[0])
            except (grpc.aio.AioRpcError, AssertionError) as err:
                failures.append(repr(err)[:200])
            ended.append(time.monotonic())

    async def probe() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                await probe_stub.Heartbeat(broker_pb2.HeartbeatRequest(replica_id="ar-probe", incarnation_id="ar-probe-inc"),
                                           timeout=60)  # fmt: skip
                t1 = time.monotonic()
                await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=60)
            except grpc.aio.AioRpcError as err:
                failures.append(repr(err)[:200])
                continue
            probes.append((t0, (t1 - t0) * 1000, (time.monotonic() - t1) * 1000))
            await asyncio.sleep(args.probe_interval)

    tasks = [asyncio.create_task(worker()) for _ in range(args.concurrency)] + [asyncio.create_task(probe())]
    await asyncio.sleep(args.warmup)
    child.stdin.write(command + "\n")
    child.stdin.flush()
    window = json.loads(await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline))
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*tasks)
    await channel.close()
    await probe_channel.close()
    t0, t1 = window["t0"], window["t1"]
    inside = [p for p in probes if t0 <= p[0] <= t1]
    window.update(
        seconds=t1 - t0,
        heartbeat_ms=[p[1] for p in inside],
        health_ms=[p[2] for p in inside],
        lifecycles=sum(1 for t in ended if t0 <= t <= t1),
        failures=failures,
    )
    return window


def one_run(workdir: Path, command: str, args: argparse.Namespace) -> dict[str, Any]:
    journal = workdir / f"{time.monotonic_ns()}.sqlite"
    cmd = [sys.executable, __file__, "--child", str(journal), str(args.rows), str(args.png_bytes), args.synchronous]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        port = int(child.stdout.readline())
        got = asyncio.run(drive(child, port, command, args))
        child.stdin.write("stop\n")
        child.stdin.flush()
    finally:
        child.stdin.close()
        child.wait(60)
    return got


def main() -> None:
    parser = SuggestingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000, help="finished generations in the journal")
    parser.add_argument("--png-bytes", type=int, default=10_000, help="each generation's PNG")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode, alternating")
    parser.add_argument("--concurrency", type=int, default=8, help="lifecycles in flight")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before the window")
    parser.add_argument("--probe-interval", type=float, default=0.002, help="seconds between probes")
    parser.add_argument("--synchronous", default="FULL", choices=["FULL", "NORMAL"])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, rows, png_bytes, synchronous = args.child
        run_broker(path, int(rows), int(png_bytes), synchronous)
        return

    workdir = Path(tempfile.mkdtemp(prefix="kvrelay-compaction-bench-", dir=os.environ.get("BENCH_DIR")))
    try:
        results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for run in range(args.runs):
            r = one_run(workdir, "compact", args)
            results["compaction"].append(r)
            print(f"run {run + 1} compaction {r['seconds'] * 1000:7.0f} ms, {r['steps']} steps, "
                  f"{r['rows_deleted']} rows, {r['size_before'] / 1e6:.1f} -> {r['size_after'] / 1e6:.2f} MB",
                  flush=True)  # fmt: skip
            # The idle window lasts as long as the compaction window just measured.
            r = one_run(workdir, f"idle {r['seconds']:.3f}", args)
            results["idle"].append(r)
            print(f"run {run + 1} idle       {r['seconds'] * 1000:7.0f} ms", flush=True)

        print(f"\n{args.rows} generations x {args.png_bytes} B, journal {args.synchronous}, group commit, "
              f"{args.runs} runs per mode, concurrency {args.concurrency}, probe every "
              f"{args.probe_interval * 1000:g} ms; figures over the window only")  # fmt: skip
        print(f"{'mode':10s} {'window ms':>9s} {'steps':>6s} {'step p50/p99/max ms':>20s} "
              f"{'loop lag p99/max ms':>20s} {'heartbeat p50/p99 ms':>21s} {'health p50/p99 ms':>18s} "
              f"{'lifecycles/s':>12s} {'failed RPCs':>11s}")  # fmt: skip
        summary: dict[str, dict[str, float]] = {}
        for mode in MODES:
            rs = results[mode]
            steps = [v for r in rs for v in r.get("step_ms", [])]
            lag = [v for r in rs for v in r["lag_ms"]]
            hb = [v for r in rs for v in r["heartbeat_ms"]]
            hc = [v for r in rs for v in r["health_ms"]]
            s = {
                "window": statistics.mean(r["seconds"] * 1000 for r in rs),
                "steps": statistics.mean(r.get("steps", 0) for r in rs),
                "st50": _pct(steps, 0.5), "st99": _pct(steps, 0.99), "stmax": max(steps, default=float("nan")),
                "lag99": _pct(lag, 0.99), "lagmax": max(lag, default=float("nan")),
                "hb50": _pct(hb, 0.5), "hb99": _pct(hb, 0.99), "hc50": _pct(hc, 0.5), "hc99": _pct(hc, 0.99),
                "rate": sum(r["lifecycles"] for r in rs) / sum(r["seconds"] for r in rs),
                "failed": sum(len(r["failures"]) for r in rs),
            }  # fmt: skip
            summary[mode] = s
            print(f"{mode:10s} {s['window']:9.0f} {s['steps']:6.0f} "
                  f"{s['st50']:6.2f}/{s['st99']:6.2f}/{s['stmax']:<6.2f} {s['lag99']:9.2f}/{s['lagmax']:<10.2f} "
                  f"{s['hb50']:10.2f}/{s['hb99']:<10.2f} {s['hc50']:8.2f}/{s['hc99']:<9.2f} "
                  f"{s['rate']:12.1f} {s['failed']:11.0f}")  # fmt: skip
            for r in rs:
                for failure in r["failures"][:3]:
                    print(f"  {mode} failure: {failure}")
        a, b = summary["compaction"], summary["idle"]
        print(f"\ncompaction / idle: heartbeat p50 {a['hb50'] / b['hb50']:.2f}x, p99 {a['hb99'] / b['hb99']:.2f}x; "
              f"health p50 {a['hc50'] / b['hc50']:.2f}x, p99 {a['hc99'] / b['hc99']:.2f}x; loop lag p99 "
              f"{a['lag99'] / b['lag99']:.2f}x, max {a['lagmax'] / b['lagmax']:.2f}x; lifecycles/s "
              f"{a['rate'] / b['rate']:.2f}x")  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
