"""Cancel latency of a long CPU denoise step: from the caller's cancel to the ticket RELEASED with
outcome CANCELLED (the moment the broker has every page back), for this checkout's DiT and for a
baseline checkout's, side by side.

A step of the `tiny` preset at 2048x2048 (16384 image tokens, 2 CFG rows) takes ~10-25 s on a
shared 2-core host. The caller cancels as soon as step 1 is streamed (plus `--delay` seconds), so
step 2 is running: a DiT that stops only at step boundaries frees its pages once that step ends;
one that stops at the next abort point (before a transformer block or between two query chunks
of its attention: docs/dit_service.md, "Cancel mid-denoise") frees them within about one chunk. The broker runs in this process (BrokerCore behind its servicer), each DiT
is a real `python -m kvrelay dit` process (its code through PYTHONPATH), the KV arrives over
Mooncake TCP from a test writer: tests/dit_service/harness.py.

    git archive <commit> | tar -x -C /tmp/kv-base     # the code before the change
    .venv/bin/python benchmarks/cancel_latency.py --baseline /tmp/kv-base [--size 2048 --runs 1]

Without `--baseline` only this checkout is measured. Runs alternate baseline / this, so both see
the same neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvrelay.v1 import broker_pb2, dit_pb2, dit_pb2_grpc  # noqa: E402
from tests.dit_service.harness import (  # noqa: E402
    ArWriter,
    DitProcess,
    inprocess_broker,
    wait_serving,
    write_config,
)
from tests.procs import start_service  # noqa: E402


async def _released(writer: ArWriter, ticket_id: str, timeout: float) -> broker_pb2.Ticket:
    deadline = time.monotonic() + timeout
    while True:
        ticket = await writer.ticket(ticket_id)
        if ticket.state == broker_pb2.TICKET_STATE_RELEASED or time.monotonic() > deadline:
            return ticket
        await asyncio.sleep(0.02)


async def measure(code: Path, size: int, delay: float, tp: int) -> dict[str, Any]:
    """One cancel on a fresh DiT running `code`: seconds of step 1, cancel -> released."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        config = write_config(tmp_path, transport="mooncake", tp=tp, transfer_timeout=60.0)
        cfg = yaml.safe_load(config.read_text())
        for stage in cfg["stages"]:
            stage["request_timeout_seconds"] = 3600  # a step of 2048x2048 on a loaded host: tens of s
        config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        async with inprocess_broker() as (broker, _core):
            started = start_service(["dit", "--config", str(config), "--replica", "0", "--broker", broker.address],
                                    cwd=tmp_path, env={"PYTHONPATH": str(code)}, timeout=120.0)
            dit = DitProcess(started.proc, started.address, started.lines)
            try:
                await wait_serving(dit, timeout=300.0)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.written_ticket([12, 4], seed=5)
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    call = dit_pb2_grpc.DitServiceStub(channel).Denoise(dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, width=size, height=size, num_inference_steps=20,
                        guidance_scale=2.0, seed=2), timeout=3600.0)
                    loaded = step1 = 0.0
                    async for event in call:
                        if event.phase == dit_pb2.DENOISE_PHASE_LOADED:
                            loaded = time.monotonic()
                        elif event.phase == dit_pb2.DENOISE_PHASE_STEP:
                            step1 = time.monotonic()
                            break
                    await asyncio.sleep(delay)
                    call.cancel()
                    cancelled = time.monotonic()
                released = await _released(writer, ticket.ticket_id, 600.0)
                stop = time.monotonic() - cancelled
                pool = await writer.pool()
                if released.state != broker_pb2.TICKET_STATE_RELEASED or pool.free_pages != pool.total_pages:
                    raise RuntimeError(f"ticket {released.state}, pool {pool.free_pages}/{pool.total_pages} free")
                if released.outcome != broker_pb2.TICKET_OUTCOME_CANCELLED:
                    raise RuntimeError(f"released with outcome {released.outcome}, not CANCELLED")
                await writer.close()
                return {"step1_s": step1 - loaded, "cancel_to_released_s": stop}
            finally:
                await asyncio.to_thread(dit.stop)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=2048, help="image width = height (tiny preset)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--delay", type=float, default=0.0, help="seconds after step 1 is streamed before cancelling")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--baseline", type=Path, help="a checkout of the code before the change")
    a = p.parse_args()
    checkouts = {"baseline": a.baseline.resolve(), "this": REPO} if a.baseline else {"this": REPO}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    for run in range(a.runs):
        for name, code in checkouts.items():
            r = asyncio.run(measure(code, a.size, a.delay, a.tp))
            results[name].append(r)
            print(f"run {run + 1} {name:8s}: step 1 {r['step1_s']:6.2f} s, "
                  f"cancel -> CANCELLED + pages back {r['cancel_to_released_s']:6.2f} s", flush=True)
    print(f"\ntiny {a.size}x{a.size}, 2 CFG rows, TP={a.tp}, cancel {a.delay:.1f} s into step 2, "
          f"median of {a.runs}:")
    print(f"{'checkout':10s} {'step (s)':>9s} {'cancel->released (s)':>21s} {'released/step':>14s}")
    medians = {}
    for name, rs in results.items():
        step = statistics.median(r["step1_s"] for r in rs)
        stop = statistics.median(r["cancel_to_released_s"] for r in rs)
        medians[name] = stop
        print(f"{name:10s} {step:9.2f} {stop:21.2f} {stop / step:14.2f}")
    if "baseline" in medians:
        print(f"cancel -> released: this / baseline = {medians['this'] / medians['baseline']:.2f}x")


if __name__ == "__main__":
    main()
