"""The DiT service end to end: a real `python -m kvrelay dit` process, a real broker (BrokerCore
behind the BrokerService servicer), and an AR writer the test controls."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvrelay.errors import reason_of
from kvrelay.models.dit import DitRunner
from kvrelay.models.image import decode_png
from kvrelay.v1 import broker_pb2, dit_pb2, dit_pb2_grpc
from tests.dit_service.harness import (
    ArWriter,
    SharedReplica,
    broker_process,
    inprocess_broker,
    start_dit,
    wait_serving,
    write_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedReplica]:
    """The broker and DiT (TP=1, the harness's config) of the tests below that take `replica`."""
    with SharedReplica(tmp_path_factory.mktemp("shared-dit"), transport="mooncake") as shared:
        yield shared


@pytest.fixture
def replica(shared_replica: SharedReplica) -> Iterator[SharedReplica]:
    with shared_replica.test():
        yield shared_replica


async def _collect(stub: dit_pb2_grpc.DitServiceStub, request: dit_pb2.DenoiseRequest,
                   timeout: float = 60.0) -> list[dit_pb2.DenoiseEvent]:
    return [event async for event in stub.Denoise(request, timeout=timeout)]


async def _denoise_matches_local_and_frees_pages(broker: Any, dit: Any, quantization: str | None) -> None:
    writer = ArWriter(broker.address, "tiny", "mooncake")
    await writer.register()
    counts = [21, 5]
    ticket = await writer.create_ticket(counts)
    armed = await writer.arm(ticket.ticket_id)
    prefixes = writer.rows_kv(counts, seed=7)
    async with grpc.aio.insecure_channel(dit.address) as channel:
        stub = dit_pb2_grpc.DitServiceStub(channel)
        request = dit_pb2.DenoiseRequest(ticket_id=ticket.ticket_id, request_id=ticket.request_id,
                                         width=64, height=64, num_inference_steps=3,
                                         guidance_scale=2.0, seed=11)
        denoise = asyncio.ensure_future(_collect(stub, request))
        outcomes = await asyncio.to_thread(writer.write, armed, prefixes)
        assert all(o.ok for o in outcomes), outcomes
        await writer.report(ticket.ticket_id, outcomes)
        events = await denoise
    phases = [e.phase for e in events]
    assert phases == [dit_pb2.DENOISE_PHASE_LOADING, dit_pb2.DENOISE_PHASE_LOADED,
                      *[dit_pb2.DENOISE_PHASE_STEP] * 3, dit_pb2.DENOISE_PHASE_DECODED], phases
    assert [e.step for e in events if e.phase == dit_pb2.DENOISE_PHASE_STEP] == [1, 2, 3]
    final = events[-1]
    assert final.bytes_loaded == sum(o.bytes for o in outcomes) > 0
    image = decode_png(final.image.png)
    local = DitRunner("tiny", quantization=quantization).generate(
        prefixes, width=64, height=64, steps=3, guidance_scale=2.0, seed=11).numpy()
    assert image.shape == (64, 64, 3)
    # Different thread counts may round matmuls differently; the prefix itself is exact
    # (test_transfer_bits), so the image agrees to within one level.
    assert int(np.abs(image.astype(int) - local.astype(int)).max()) <= 1
    pool = await writer.pool()
    assert (pool.free_pages, pool.reserved_pages, pool.draining_pages) == (pool.total_pages, 0, 0)
    released = await writer.ticket(ticket.ticket_id)
    assert released.state == broker_pb2.TICKET_STATE_RELEASED
    assert released.outcome == broker_pb2.TICKET_OUTCOME_OK
    await writer.close()


def test_denoise_over_mooncake_matches_local_and_frees_pages(replica: SharedReplica) -> None:
    replica.run(_denoise_matches_local_and_frees_pages(replica.broker, replica.dit, None))


def test_denoise_over_mooncake_in_fp8_matches_the_local_fp8_image(tmp_path: Path) -> None:
    """The stage's `model.quantization` reaches the ranks (`kvrelay dit` -> DitRankSpec ->
    DitRunner): the image is the local FP8 runner's."""
    config = write_config(tmp_path, transport="mooncake", quantization="fp8")

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                await _denoise_matches_local_and_frees_pages(broker, dit, "fp8")
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def _fetch_metric(port: int, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exported")


async def _wait_ticket(writer: ArWriter, ticket_id: str, state: int, timeout: float) -> broker_pb2.Ticket:
    deadline = time.monotonic() + timeout
    while True:
        ticket = await writer.ticket(ticket_id)
        if ticket.state == state or time.monotonic() > deadline:
            return ticket
        await asyncio.sleep(0.05)


def test_transfer_timeout_keeps_pages_until_late_completion(tmp_path: Path) -> None:
    """A writer still in flight at the transfer timeout: Denoise fails DEADLINE_EXCEEDED /
    TRANSFER_TIMEOUT, the pages stay reserved (DRAINING), and the late report frees them."""
    config = write_config(tmp_path, transport="mooncake", transfer_timeout=1.0, drain_quiet_seconds=0.2)

    async def scenario() -> None:
        # The real broker process: its own maintenance loop frees the pages after the quiet period.
        async with broker_process(config, tmp_path) as broker:
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                counts = [40, 3]
                ticket = await writer.create_ticket(counts)
                armed = await writer.arm(ticket.ticket_id)
                prefixes = writer.rows_kv(counts, seed=3)
                outcomes = await asyncio.to_thread(writer.write, armed, prefixes)
                # Row 0 is reported; row 1's writer has not reported yet: it is still in flight.
                await writer.report(ticket.ticket_id, [o for o in outcomes if o.row == 0])
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    stub = dit_pb2_grpc.DitServiceStub(channel)
                    request = dit_pb2.DenoiseRequest(ticket_id=ticket.ticket_id, request_id=ticket.request_id,
                                                     width=64, height=64, num_inference_steps=2,
                                                     guidance_scale=2.0, seed=1)
                    started = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _collect(stub, request, timeout=30.0)
                    waited = time.monotonic() - started
                code, reason, _ = reason_of(info.value)
                assert (code, reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), info.value
                assert 0.9 <= waited < 10.0
                ticket_now = await writer.ticket(ticket.ticket_id)
                assert ticket_now.state == broker_pb2.TICKET_STATE_DRAINING
                assert ticket_now.outcome == broker_pb2.TICKET_OUTCOME_TIMED_OUT
                pages = sum(len(r.page_ids) for r in ticket_now.rows)
                # Well past the quiet period: still held, because a write may still land.
                await asyncio.sleep(0.6)
                pool = await writer.pool()
                assert pool.draining_pages == pages and pool.free_pages == pool.total_pages - pages
                # The late completion resolves the last write: the pages free after the quiet period.
                await writer.report(ticket.ticket_id, [o for o in outcomes if o.row == 1])
                released = await _wait_ticket(writer, ticket.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 5.0)
                assert released.state == broker_pb2.TICKET_STATE_RELEASED
                pool = await writer.pool()
                assert (pool.free_pages, pool.reserved_pages, pool.draining_pages) == (pool.total_pages, 0, 0)
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_reported_bytes_that_never_match_their_checksum_are_named_in_the_timeout(tmp_path: Path) -> None:
    """A writer reports OK with a checksum its bytes do not have (a buggy sender, or a late
    foreign write over them): the DiT never reads those pages, warns once while it keeps
    re-checking, and its TRANSFER_TIMEOUT says the bytes never matched (not "not loaded")."""
    config = write_config(tmp_path, transport="mooncake", transfer_timeout=3.0)

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.create_ticket([5])
                armed = await writer.arm(ticket.ticket_id)
                outcomes = await asyncio.to_thread(writer.write, armed, writer.rows_kv([5], seed=6))
                await writer.report(ticket.ticket_id, [dataclasses.replace(o, checksum=o.checksum ^ 1)
                                                       for o in outcomes])
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _collect(dit_pb2_grpc.DitServiceStub(channel), dit_pb2.DenoiseRequest(
                            ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=2,
                            guidance_scale=1.0, seed=0), timeout=30.0)
                code, reason, message = reason_of(info.value)
                assert (code, reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT"), info.value
                assert "were reported written but never matched their checksums" in message, message
                warned = [line for line in dit.lines if "load_checksums_mismatching" in line]
                assert len(warned) == 1, "".join(dit.lines[-30:])
                assert ticket.ticket_id in warned[0]
                released = await _wait_ticket(writer, ticket.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
                assert released.state == broker_pb2.TICKET_STATE_RELEASED
                pool = await writer.pool()
                assert pool.free_pages == pool.total_pages
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


async def _next_request_runs_to_the_end(dit: Any, writer: ArWriter) -> None:
    """No rank is left in a collective or a step: the next request runs to the end."""
    ticket = await writer.written_ticket([5], seed=6)
    async with grpc.aio.insecure_channel(dit.address) as channel:
        events = await _collect(
            dit_pb2_grpc.DitServiceStub(channel),
            dit_pb2.DenoiseRequest(
                ticket_id=ticket.ticket_id,
                width=64,
                height=64,
                num_inference_steps=2,
                guidance_scale=1.0,
                seed=0,
            ),
        )
    assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED


async def _cancel_mid_denoise_stops_within_one_step(dit: Any, writer: ArWriter, metrics_port: int) -> None:
    """With TP=2 both ranks must stop after the same step (a rank left in a collective would hang
    the replica), and the replica must serve the next request."""
    total = 200
    steps_before = _fetch_metric(metrics_port, "kvrelay_dit_denoise_steps_total")
    # One CFG row (guidance 1): a step of less CPU work than two rows' (the same 4096
    # image tokens).
    counts = [12]
    ticket = await writer.written_ticket(counts, seed=5)
    async with grpc.aio.insecure_channel(dit.address) as channel:
        stub = dit_pb2_grpc.DitServiceStub(channel)
        # 1024x1024 (4096 tokens): a step takes far longer than the service's 10 ms step
        # poll and the event's trip to us, so "seen" is at most a step behind the ranks.
        call = stub.Denoise(
            dit_pb2.DenoiseRequest(
                ticket_id=ticket.ticket_id,
                width=1024,
                height=1024,
                num_inference_steps=total,
                guidance_scale=1.0,
                seed=2,
            ),
            timeout=60.0,
        )
        seen = 0
        async for event in call:
            if event.phase == dit_pb2.DENOISE_PHASE_STEP:
                seen = event.step
                if seen >= 2:
                    break
        call.cancel()
        cancelled_at = time.monotonic()
    released = await _wait_ticket(writer, ticket.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
    assert released.state == broker_pb2.TICKET_STATE_RELEASED
    assert released.outcome == broker_pb2.TICKET_OUTCOME_CANCELLED
    stop_seconds = time.monotonic() - cancelled_at
    steps_run = _fetch_metric(metrics_port, "kvrelay_dit_denoise_steps_total") - steps_before
    # The ranks may be one step ahead of the stream when the caller cancels, and finish
    # the step they are in: never more than that.
    assert seen <= steps_run <= seen + 2, (seen, steps_run)
    assert steps_run < total
    assert stop_seconds < 5.0
    pool = await writer.pool()
    assert pool.free_pages == pool.total_pages
    # The ranks are in step again: the next request runs to the end.
    await _next_request_runs_to_the_end(dit, writer)


def _logged(lines: list[str], event: str) -> list[dict[str, Any]]:
    """The DiT's JSON log records of `event` (structlog, one JSON object a line)."""
    import json

    records = []
    for raw in list(lines):
        line = raw.strip()
        if line.startswith("{") and f'"{event}"' in line:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == event:
                    records.append(record)
    return records


async def _cancel_mid_step_aborts_the_step_at_a_block(
    dit: Any, writer: ArWriter, metrics_port: int, tp: int
) -> None:
    """A CPU step of seconds (tiny at 1536x1536: 9216 image tokens) is not run to its end after a
    cancel: the ranks (both, at the same point, with TP=2) abandon it at the next abort point
    (before a transformer block, or between two query chunks of its attention), the ticket is
    released CANCELLED with every page back, and the replica serves the next request. The caller
    cancels as soon as step 1 is streamed, so step 2 is running: it must never count as done."""
    total = 20
    steps_before = _fetch_metric(metrics_port, "kvrelay_dit_denoise_steps_total")
    cancels_before = len(_logged(dit.lines, "denoise_cancelled"))
    # One CFG row (guidance 1): half the CPU work of a step of two rows, the same 9216
    # image tokens, so the same blocks and attention chunks to abort at.
    ticket = await writer.written_ticket([12], seed=5)
    async with grpc.aio.insecure_channel(dit.address) as channel:
        stub = dit_pb2_grpc.DitServiceStub(channel)
        call = stub.Denoise(
            dit_pb2.DenoiseRequest(
                ticket_id=ticket.ticket_id,
                width=1536,
                height=1536,
                num_inference_steps=total,
                guidance_scale=1.0,
                seed=2,
            ),
            timeout=300.0,
        )
        loaded_at = step1_at = 0.0
        async for event in call:
            if event.phase == dit_pb2.DENOISE_PHASE_LOADED:
                loaded_at = time.monotonic()
            if event.phase == dit_pb2.DENOISE_PHASE_STEP:
                assert event.step == 1
                step1_at = time.monotonic()
                break
        call.cancel()
        cancelled_at = time.monotonic()
    released = await _wait_ticket(writer, ticket.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 120.0)
    stop_seconds = time.monotonic() - cancelled_at
    assert released.state == broker_pb2.TICKET_STATE_RELEASED
    assert released.outcome == broker_pb2.TICKET_OUTCOME_CANCELLED
    pool = await writer.pool()
    assert pool.free_pages == pool.total_pages
    # Step 2 was running when the cancel came: it never finished (at a step boundary it
    # would have: 2 steps counted), the ranks left it at an abort point.
    assert _fetch_metric(metrics_port, "kvrelay_dit_denoise_steps_total") - steps_before == 1
    (record,) = _logged(dit.lines, "denoise_cancelled")[cancels_before:]
    assert record["steps_done"] == 1, record
    # With TP=2, rank 1 may reach the step-1 boundary after the cancel came (rank 0 had
    # streamed step 1 already): then the ranks' vote there stops them before step 2
    # (aborted_step null), as good. One rank has no such race: it is inside step 2.
    if tp == 1 or record["aborted_step"] is not None:
        assert record["aborted_step"] == 2, record
        assert record["aborted_block"] in (0, 1), record  # tiny: 2 blocks
        assert 0 <= record["aborted_chunk"] < 5, record  # 2 x 9216 folded queries: 5 chunks
    print(f"first step {step1_at - loaded_at:.2f}s, cancel to release {stop_seconds:.2f}s")
    await _next_request_runs_to_the_end(dit, writer)


async def _both_cancels(broker: Any, dit: Any, tp: int) -> None:
    metrics_port = dit.metrics_port()
    assert metrics_port is not None
    writer = ArWriter(broker.address, "tiny", "mooncake")
    await writer.register()
    await _cancel_mid_denoise_stops_within_one_step(dit, writer, metrics_port)
    await _cancel_mid_step_aborts_the_step_at_a_block(dit, writer, metrics_port, tp)
    await writer.close()


def test_a_cancel_stops_within_one_step_and_mid_step_at_a_block(replica: SharedReplica) -> None:
    """Both cancels, one after the other, on one DiT replica (TP=1; TP=2 below): a cancel between
    steps stops the ranks within one step, a cancel inside a step abandons it at the next abort
    point; each time the ticket is released CANCELLED with every page back and the next request
    runs to the end."""
    replica.run(_both_cancels(replica.broker, replica.dit, 1))


def test_a_cancel_stops_both_tp2_ranks_within_one_step_and_mid_step_at_a_block(tmp_path: Path) -> None:
    config = write_config(tmp_path, transport="mooncake", tp=2)

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                await _both_cancels(broker, dit, 2)
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


@pytest.mark.parametrize(("tp", "sp"), [(2, 1), (1, 2)])
def test_tp2_and_sp2_service_images_equal_tp1(tmp_path: Path, tp: int, sp: int) -> None:
    """Two rank workers, each verifying and reading its own head shard's pages: the image equals
    the TP=1 image within fp32 rounding (reductions split across ranks sum in another order)."""
    config = write_config(tmp_path, transport="mooncake", tp=tp, sp=sp)

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                counts = [19, 6]
                ticket = await writer.create_ticket(counts)
                armed = await writer.arm(ticket.ticket_id)
                assert sorted({w.dst_rank for w in armed.writes}) == [0, 1]
                prefixes = writer.rows_kv(counts, seed=21)
                outcomes = await asyncio.to_thread(writer.write, armed, prefixes)
                await writer.report(ticket.ticket_id, outcomes)
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    events = await _collect(dit_pb2_grpc.DitServiceStub(channel), dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=2,
                        guidance_scale=2.0, seed=3))
                assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
                image = decode_png(events[-1].image.png).astype(int)
                local = DitRunner("tiny").generate(prefixes, width=64, height=64, steps=2, guidance_scale=2.0,
                                                   seed=3).numpy().astype(int)
                assert int(np.abs(image - local).max()) <= 2
                assert (await writer.ticket(ticket.ticket_id)).state == broker_pb2.TICKET_STATE_RELEASED
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_fenced_replica_fails_stop_with_exit_3(tmp_path: Path) -> None:
    """The broker fences the replica (a broken invariant): the next heartbeat says so and the DiT
    stops its workers, frees its memory and exits 3 for its supervisor to restart it."""
    config = write_config(tmp_path, transport="mooncake", lease_seconds=0.6)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=0.6) as (broker, core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                assert len(list(Path("/dev/shm").glob(f"kvrelay-dit-0-{dit.proc.pid}-*"))) == 2  # pool + control
                core.fence_replica("dit-0", "test: broken invariant")
                deadline = time.monotonic() + 15.0
                while dit.proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert dit.proc.poll() == 3, "".join(dit.lines[-30:])
                # Workers stopped, then the page pools freed: nothing of this incarnation is left.
                assert list(Path("/dev/shm").glob(f"kvrelay-dit-0-{dit.proc.pid}-*")) == []
            finally:
                await asyncio.to_thread(dit.stop)

    asyncio.run(scenario())


def _rank_pids(pid: int) -> list[int]:
    """The rank worker processes of the DiT process `pid` (spawned children), by /proc."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    ranks = []
    for child in children:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                ranks.append(child)
    return ranks


def test_dead_rank_fails_stop(tmp_path: Path) -> None:
    """A missing worker rank is a broken invariant: with a request waiting for its rows, killing a
    rank ends that request and the process fails stop (exit 3), pools freed after the workers."""
    config = write_config(tmp_path, transport="mooncake")

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.create_ticket([8, 2])
                await writer.arm(ticket.ticket_id)
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    call = dit_pb2_grpc.DitServiceStub(channel).Denoise(dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=2,
                        guidance_scale=2.0, seed=1), timeout=30.0)
                    first = await call.read()
                    assert first.phase == dit_pb2.DENOISE_PHASE_LOADING
                    [rank] = _rank_pids(dit.proc.pid)
                    os.kill(rank, signal.SIGKILL)
                    with pytest.raises(grpc.aio.AioRpcError):
                        while await call.read() is not grpc.aio.EOF:
                            pass
                # (In a thread: this loop serves the broker the exiting DiT releases its ticket with.)
                assert await asyncio.to_thread(dit.proc.wait, 20) == 3, "".join(dit.lines[-30:])
                assert list(Path("/dev/shm").glob(f"kvrelay-dit-0-{dit.proc.pid}-*")) == []
                # The handler released the ticket on its way out; its armed, unwritten pages drain
                # (never silently reused) until the writer reports or is proven gone.
                ended = await writer.ticket(ticket.ticket_id)
                assert ended.state == broker_pb2.TICKET_STATE_DRAINING, "".join(dit.lines[-25:])
                assert ended.outcome == broker_pb2.TICKET_OUTCOME_CANCELLED
                await writer.close()
            finally:
                await asyncio.to_thread(dit.stop)

    asyncio.run(scenario())


def test_admission_in_reservation_order_through_the_service(replica: SharedReplica) -> None:
    """max_num_seqs=1: while ticket A denoises and S (reserved last, but the only caller then)
    waits as its standby, ticket C's Denoise arrives before B's; B was reserved first, so B is
    admitted (LOADING) before C."""
    broker, dit = replica.broker, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "mooncake")
        await writer.register()
        tickets = [await writer.create_ticket([6]) for _ in range(4)]  # A, B, C, S in reservation order
        for t in tickets:
            armed = await writer.arm(t.ticket_id)
            outcomes = await asyncio.to_thread(writer.write, armed, writer.rows_kv([6], seed=0))
            await writer.report(t.ticket_id, outcomes)
        order: list[str] = []

        async def run(ticket: broker_pb2.Ticket, name: str, steps: int, started: asyncio.Event) -> None:
            size = 512 if steps > 1 else 64
            async for event in stub.Denoise(dit_pb2.DenoiseRequest(
                    ticket_id=ticket.ticket_id, width=size, height=size, num_inference_steps=steps,
                    guidance_scale=1.0, seed=0), timeout=60.0):
                if event.phase == dit_pb2.DENOISE_PHASE_LOADING:
                    order.append(name)
                if event.phase == dit_pb2.DENOISE_PHASE_STEP:
                    started.set()

        async with grpc.aio.insecure_channel(dit.address) as channel:
            stub = dit_pb2_grpc.DitServiceStub(channel)
            a_running, unused = asyncio.Event(), asyncio.Event()
            # A runs until the test cancels it, so B and C surely both wait for its slot.
            a = asyncio.ensure_future(run(tickets[0], "A", 1000, a_running))
            await a_running.wait()
            s = asyncio.ensure_future(run(tickets[3], "S", 1, unused))
            await asyncio.sleep(0.3)
            c = asyncio.ensure_future(run(tickets[2], "C", 1, unused))
            await asyncio.sleep(0.3)
            b = asyncio.ensure_future(run(tickets[1], "B", 1, unused))
            await asyncio.sleep(0.3)
            assert order == ["A", "S"] and not s.done()  # S waits for A's ranks, admitted
            a.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await a
            await asyncio.gather(s, b, c)
        assert order == ["A", "S", "B", "C"]
        await writer.close()

    replica.run(scenario())


def test_sigterm_during_denoise_releases_and_exits_cleanly(tmp_path: Path) -> None:
    """SIGTERM: health goes NOT_SERVING, the in-flight Denoise gets the grace period, then is
    stopped within a step and its ticket released, before the workers and the pools go; exit 0."""
    config = write_config(tmp_path, transport="mooncake")

    async def scenario() -> None:
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.written_ticket([10], seed=0)
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    call = dit_pb2_grpc.DitServiceStub(channel).Denoise(dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, width=512, height=512, num_inference_steps=1000,
                        guidance_scale=1.0, seed=0), timeout=60.0)
                    while (await call.read()).phase != dit_pb2.DENOISE_PHASE_STEP:
                        pass
                    dit.proc.send_signal(signal.SIGTERM)
                    with pytest.raises(grpc.aio.AioRpcError):
                        while await call.read() is not grpc.aio.EOF:
                            pass
                assert await asyncio.to_thread(dit.proc.wait, 30) == 0, "".join(dit.lines[-30:])
                released = await writer.ticket(ticket.ticket_id)
                assert released.state == broker_pb2.TICKET_STATE_RELEASED
                assert released.outcome == broker_pb2.TICKET_OUTCOME_CANCELLED
                assert list(Path("/dev/shm").glob(f"kvrelay-dit-0-{dit.proc.pid}-*")) == []
                await writer.close()
            finally:
                await asyncio.to_thread(dit.stop)

    asyncio.run(scenario())


def test_survives_a_broker_restart(tmp_path: Path) -> None:
    """The broker process restarts (same port, same journal) while a Denoise waits for its rows:
    that request ends (its armed ticket comes back DRAINING), the DiT keeps serving, and the next
    request on the restarted broker succeeds."""
    from tests.procs import start_service

    config = write_config(tmp_path, transport="mooncake", transfer_timeout=30.0)

    async def scenario() -> None:
        args = ["broker", "--config", str(config), "--metrics-port", "0"]
        broker = await asyncio.to_thread(start_service, [*args, "--port", "0"], cwd=tmp_path)
        port = broker.address.rsplit(":", 1)[1]
        dit = start_dit(config, broker.address, cwd=tmp_path)
        try:
            await wait_serving(dit)
            writer = ArWriter(broker.address, "tiny", "mooncake")
            await writer.register()
            ticket = await writer.create_ticket([10])
            await writer.arm(ticket.ticket_id)
            async with grpc.aio.insecure_channel(dit.address) as channel:
                stub = dit_pb2_grpc.DitServiceStub(channel)
                call = stub.Denoise(dit_pb2.DenoiseRequest(ticket_id=ticket.ticket_id, width=64, height=64,
                                                           num_inference_steps=1, guidance_scale=1.0), timeout=60.0)
                assert (await call.read()).phase == dit_pb2.DENOISE_PHASE_LOADING
                assert await asyncio.to_thread(broker.stop) == 0
                broker = await asyncio.to_thread(start_service, [*args, "--port", port], cwd=tmp_path)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                assert reason_of(info.value)[1] == "TICKET_ENDED", info.value
                assert dit.proc.poll() is None
                # A new request through the restarted broker, once the DiT's heartbeat renewed its
                # lease there (the restarted broker counts no replica up before it hears from it).
                await writer.register()
                counts = [9]
                for _ in range(100):
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        ticket = await writer.create_ticket(counts)
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the DiT never came back up on the restarted broker")
                armed = await writer.arm(ticket.ticket_id)
                await writer.report(ticket.ticket_id, await asyncio.to_thread(
                    writer.write, armed, writer.rows_kv(counts, seed=4)))
                events = await _collect(stub, dit_pb2.DenoiseRequest(
                    ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=1, guidance_scale=1.0))
                assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
            await writer.close()
        finally:
            assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])
            await asyncio.to_thread(broker.stop)

    asyncio.run(scenario())


def test_a_cancel_while_the_ok_release_is_sent_still_releases(tmp_path: Path) -> None:
    """Found cancelling 150 of 300 generations at once: the broker cancelled a Denoise call just
    as the DiT, done denoising, sent ReleaseTicket(OK); the cancel cut that RPC off and nothing
    released the ticket again, so it stayed CONSUMING with its pages reserved for good. Here the
    broker holds the first OK release until the test has cancelled the call."""
    from kvrelay.broker.service import BrokerServicer

    config = write_config(tmp_path, transport="mooncake")

    async def scenario() -> None:
        arrived, go = asyncio.Event(), asyncio.Event()

        class HeldRelease(BrokerServicer):
            async def ReleaseTicket(self, request: Any, context: Any) -> Any:  # noqa: N802
                if request.outcome == broker_pb2.TICKET_OUTCOME_OK and not arrived.is_set():
                    arrived.set()
                    await go.wait()
                return await super().ReleaseTicket(request, context)

        async with inprocess_broker(servicer_class=HeldRelease) as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.written_ticket([5], seed=6)
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    call = dit_pb2_grpc.DitServiceStub(channel).Denoise(dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=2,
                        guidance_scale=1.0, seed=0), timeout=60.0)
                    await asyncio.wait_for(arrived.wait(), 30.0)
                    call.cancel()
                    await asyncio.sleep(0.5)  # the DiT sees the cancel while its release is held
                go.set()
                released = await _wait_ticket(writer, ticket.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
                assert released.state == broker_pb2.TICKET_STATE_RELEASED
                pool = await writer.pool()
                assert pool.free_pages == pool.total_pages
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_a_release_that_fails_while_a_reregistration_lists_its_ticket_is_still_delivered(tmp_path: Path) -> None:
    """The race of the sixth session's note, in a fixed order. The broker forgets the DiT while
    ticket T is being read (the DiT's heartbeat is refused NOT_FOUND): the DiT re-registers,
    listing T as held, and the broker holds that RegisterReplica. The call then ends and its
    ReleaseTicket(OK) is refused UNAVAILABLE (the broker dropped again). Only then does the
    held registration go through, keeping T; then the broker answers again. The release must
    still reach it: before, the DiT gave up after six tries and T stayed CONSUMING, its pages
    reserved, until the DiT's next re-registration (none ever came)."""
    from kvrelay.broker.service import BrokerServicer
    from kvrelay.broker.tickets import TicketOutcome, TicketState

    config = write_config(tmp_path, transport="mooncake")

    async def scenario() -> None:
        forget = asyncio.Event()  # the broker no longer knows dit-0 (until it registers again)
        registering, go_register, registered = asyncio.Event(), asyncio.Event(), asyncio.Event()
        listed: list[list[str]] = []
        dropped = True  # ReleaseTicket from the DiT is refused UNAVAILABLE while set
        refused_releases: list[str] = []

        class Racing(BrokerServicer):
            async def StartConsuming(self, request: Any, context: Any) -> Any:  # noqa: N802
                # The call is admitted and reads its ticket now: have the broker forget the DiT
                # and let the call go on only once the re-registration listing it is on its way.
                forget.set()
                await asyncio.wait_for(registering.wait(), 4.0)
                return await super().StartConsuming(request, context)

            async def Heartbeat(self, request: Any, context: Any) -> Any:  # noqa: N802
                if request.replica_id == "dit-0" and forget.is_set() and not registered.is_set():
                    await context.abort(grpc.StatusCode.NOT_FOUND, "the broker restarted; register again")
                return await super().Heartbeat(request, context)

            async def RegisterReplica(self, request: Any, context: Any) -> Any:  # noqa: N802
                if request.replica.replica_id == "dit-0" and forget.is_set() and not registered.is_set():
                    listed.append(list(request.held_ticket_ids))
                    registering.set()
                    await go_register.wait()
                    reply = await super().RegisterReplica(request, context)
                    registered.set()
                    return reply
                return await super().RegisterReplica(request, context)

            async def ReleaseTicket(self, request: Any, context: Any) -> Any:  # noqa: N802
                if dropped:
                    refused_releases.append(request.ticket_id)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the broker dropped again")
                return await super().ReleaseTicket(request, context)

        async with inprocess_broker(servicer_class=Racing) as (broker, core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.written_ticket([5], seed=6)
                tid = ticket.ticket_id
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    events = await _collect(dit_pb2_grpc.DitServiceStub(channel), dit_pb2.DenoiseRequest(
                        ticket_id=tid, width=64, height=64, num_inference_steps=2, guidance_scale=1.0, seed=0))
                # The call is over and its release was refused: the DiT stopped waiting for it.
                assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
                assert refused_releases and set(refused_releases) == {tid}
                assert listed == [[tid]], listed
                go_register.set()
                await asyncio.wait_for(registered.wait(), 10.0)
                assert core.get_ticket(tid).state is TicketState.CONSUMING, "the listing keeps the ticket"
                dropped = False
                released = await _wait_ticket(writer, tid, broker_pb2.TICKET_STATE_RELEASED, 10.0)
                assert released.state == broker_pb2.TICKET_STATE_RELEASED, (
                    f"the undelivered release was lost: ticket {broker_pb2.TicketState.Name(released.state)}")
                assert core.get_ticket(tid).outcome is TicketOutcome.OK, "the call's own outcome reached the broker"
                pool = await writer.pool()
                assert pool.free_pages == pool.total_pages
                await writer.close()
            finally:
                go_register.set()
                registering.set()
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_a_release_owed_across_a_broker_restart_is_recorded_with_the_calls_outcome(tmp_path: Path) -> None:
    """Ticket T's call makes its image, but its ReleaseTicket(OK) is refused (the broker is going
    down): owed. The broker restarts on its journal (same port) and still refuses releases; the
    DiT re-registers (same incarnation), reporting T in `owed_releases` with OK. The broker's
    reconciliation releases T recording OK (before: FAILED BROKER_RESTARTED, the orphaning's),
    once: the owed ReleaseTicket that gets through later changes nothing."""
    from kvrelay.broker.service import BrokerServicer
    from kvrelay.broker.tickets import TicketOutcome, TicketState

    config = write_config(tmp_path, transport="mooncake")
    journal = tmp_path / "restarting-broker.sqlite"
    registrations: list[broker_pb2.RegisterReplicaRequest] = []
    answered: list[str] = []  # the ReleaseTickets let through, answered
    refusing = True

    class RefusingReleases(BrokerServicer):
        async def RegisterReplica(self, request: Any, context: Any) -> Any:  # noqa: N802
            reply = await super().RegisterReplica(request, context)
            if request.replica.replica_id == "dit-0":
                # Once the broker has applied it: the test reads the tickets as it left them (read
                # before, a restored ticket was still CONSUMING with the orphaning's FAILED).
                registrations.append(request)
            return reply

        async def ReleaseTicket(self, request: Any, context: Any) -> Any:  # noqa: N802
            if refusing:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the broker is going down")
            try:
                return await super().ReleaseTicket(request, context)
            finally:
                answered.append(request.ticket_id)

    async def scenario() -> None:
        nonlocal refusing
        first: Any = inprocess_broker(journal_path=journal, servicer_class=RefusingReleases)
        restarted: Any = None
        broker, core = await first.__aenter__()
        dit = start_dit(config, broker.address, cwd=tmp_path)
        try:
            await wait_serving(dit)
            writer = ArWriter(broker.address, "tiny", "mooncake")
            await writer.register()
            ticket = await writer.written_ticket([5], seed=6)
            tid = ticket.ticket_id
            async with grpc.aio.insecure_channel(dit.address) as channel:
                events = await _collect(dit_pb2_grpc.DitServiceStub(channel), dit_pb2.DenoiseRequest(
                    ticket_id=tid, width=64, height=64, num_inference_steps=1, guidance_scale=1.0, seed=0))
            assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
            assert core.get_ticket(tid).state is TicketState.CONSUMING
            registrations.clear()
            await first.__aexit__(None, None, None)  # the journal is all that survives
            first = None
            restarted = inprocess_broker(journal_path=journal, port=broker.bound_port,
                                         servicer_class=RefusingReleases)
            _, core = await restarted.__aenter__()
            for _ in range(200):
                if registrations:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the DiT never registered with the restarted broker")
            owed = [(o.ticket_id, o.outcome) for o in registrations[0].owed_releases]
            assert owed == [(tid, broker_pb2.TICKET_OUTCOME_OK)]
            assert tid not in registrations[0].held_ticket_ids
            released = core.get_ticket(tid)
            assert (released.state, released.outcome) == (TicketState.RELEASED, TicketOutcome.OK), released
            assert core.released_total == 1
            refusing = False
            # The owed release's next try (backoff up to 2 s) gets through, and changes nothing.
            for _ in range(200):
                if tid in answered:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the owed release was never tried again")
            assert core.get_ticket(tid).outcome is TicketOutcome.OK and core.released_total == 1
            pool = await writer.pool()
            assert pool.free_pages == pool.total_pages
            await writer.close()
        finally:
            assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])
            for running in (restarted, first):
                if running is not None:
                    await running.__aexit__(None, None, None)

    asyncio.run(scenario())


def test_a_second_denoise_of_a_ticket_never_releases_it_under_the_first(replica: SharedReplica) -> None:
    """The broker sends one Denoise per ticket. A second one for a ticket a call is reading (a
    replay, a caller that holds the replica token) is refused FAILED_PRECONDITION TICKET_BUSY
    before it owns anything: before, it queued behind the first, and its end (its deadline here)
    released the ticket CANCELLED while the first call's ranks still read the pages."""
    from kvrelay.broker.tickets import TicketOutcome, TicketState

    broker, core, dit = replica.broker, replica.core, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "mooncake")
        await writer.register()
        t = await writer.create_ticket([5])
        armed = await writer.arm(t.ticket_id)
        await writer.report(t.ticket_id,
                            await asyncio.to_thread(writer.write, armed, writer.rows_kv([5], seed=6)))
        request = dit_pb2.DenoiseRequest(ticket_id=t.ticket_id, width=256, height=256,
                                         num_inference_steps=60, guidance_scale=1.0, seed=0)
        async with grpc.aio.insecure_channel(dit.address) as channel:
            stub = dit_pb2_grpc.DitServiceStub(channel)
            first = asyncio.ensure_future(_collect(stub, request))
            for _ in range(400):
                if core.get_ticket(t.ticket_id).state is TicketState.CONSUMING:
                    break
                await asyncio.sleep(0.01)
            assert core.get_ticket(t.ticket_id).state is TicketState.CONSUMING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, request, timeout=1.0)
            assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "TICKET_BUSY"), info.value
            assert core.get_ticket(t.ticket_id).state is TicketState.CONSUMING
            events = await first
        assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
        done = core.get_ticket(t.ticket_id)
        assert (done.state, done.outcome) == (TicketState.RELEASED, TicketOutcome.OK)
        await writer.close()

    replica.run(scenario())


def test_a_plan_that_is_not_the_brokers_claims_no_page(replica: SharedReplica) -> None:
    """Denoise carries the broker's plan, and the load claims the plan's pages with its ticket's
    sequence. A plan that is not the broker's (a forged sequence here: a caller that holds the
    replica token) is refused FAILED_PRECONDITION PLAN_MISMATCH before any page is claimed:
    before, it was served, and its claim, numbered above every real ticket, refused the next
    ticket of those pages (TICKET_ENDED) for good. The next ticket on them is served."""
    from kvrelay.broker.service import plan_to_proto

    broker, core, dit = replica.broker, replica.core, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "mooncake")
        await writer.register()
        async with grpc.aio.insecure_channel(dit.address) as channel:
            stub = dit_pb2_grpc.DitServiceStub(channel)
            t = await writer.written_ticket([5], seed=6)
            forged = plan_to_proto(core.plan_for(t.ticket_id))
            forged.ticket.sequence += 10**12
            request = dit_pb2.DenoiseRequest(ticket_id=t.ticket_id, width=64, height=64,
                                             num_inference_steps=1, guidance_scale=1.0, seed=0, plan=forged)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _collect(stub, request, timeout=10.0)
            assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "PLAN_MISMATCH"), info.value
            await _wait_ticket(writer, t.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
            u = None
            passed_over = []
            for _ in range(64):
                candidate = await writer.written_ticket([5], seed=6)
                if set(candidate.rows[0].page_ids) & set(t.rows[0].page_ids):
                    u = candidate
                    break
                passed_over.append(candidate)
            assert u is not None, "no later ticket got the pages"
            for other in passed_over:  # written, never denoised: the replica is shared
                await writer.stub.CancelTicket(broker_pb2.CancelTicketRequest(
                    ticket_id=other.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED), timeout=5.0)
            request = dit_pb2.DenoiseRequest(ticket_id=u.ticket_id, width=64, height=64,
                                             num_inference_steps=1, guidance_scale=1.0, seed=0,
                                             plan=plan_to_proto(core.plan_for(u.ticket_id)))
            events = await _collect(stub, request, timeout=20.0)
            assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
        await writer.close()

    replica.run(scenario())


def _forge_writes(plan: broker_pb2.TicketPlan, forgery: str, page_bytes: int, pool_bytes: int) -> None:
    """The genuine ticket (rows, sequence, replica) with its writes' segments redirected."""
    first = plan.writes[0]
    if forgery == "outside_the_pool":
        del first.segments[:]
        first.segments.add(src_offset=0, dst_offset=pool_bytes + page_bytes, length=64)
    elif forgery == "other_pages":
        # Same write keys and lengths, one page further: bytes of no page of this ticket.
        for seg in first.segments:
            seg.dst_offset += page_bytes
    elif forgery == "write_named_twice":
        plan.writes.add().CopyFrom(first)
        plan.writes[-1].segments[0].dst_offset += page_bytes
    elif forgery == "a_source_rank_the_heads_do_not_split_into":
        # Keys consistent between the ticket and the writes: 3 AR ranks do not divide 4 kv heads.
        first.src_rank = 2
        plan.ticket.writes[0].src_rank = 2
    elif forgery == "pages_outside_the_pool":
        # A row of 400000 pages (1.2 MB of page ids): refused before it is planned.
        row = plan.ticket.rows[0]
        row.num_tokens = 400_000 * plan.dit_geometry.page_size
        row.page_ids[:] = range(400_000)
    else:
        raise AssertionError(forgery)


def test_a_plan_whose_writes_are_not_the_dits_own_is_refused_at_once(replica: SharedReplica) -> None:
    """The DiT verifies each write's segments (offsets and lengths in its pools) from its own plan
    of the ticket's rows; a Denoise plan with the genuine ticket but other segments is refused
    FAILED_PRECONDITION PLAN_MISMATCH at once. Found black-box (a caller holding the replica
    token, posing as the broker): segments outside the pool, or writes from a source rank the heads
    do not split into, were UNKNOWN with a ValueError traceback; segments over another page never matched their checksums, so the load ran to
    TRANSFER_TIMEOUT (and the broker marked the sound AR -> DiT link suspect). The ticket is
    released, every page comes back, and the genuine plan is still served."""
    from google.protobuf.timestamp_pb2 import Timestamp

    from kvrelay.broker.service import plan_to_proto
    from kvrelay.transfer.convert import geometry_from_proto
    from kvrelay.transfer.layout import PageLayout

    broker, core, dit = replica.broker, replica.core, replica.dit

    async def scenario() -> None:
        writer = ArWriter(broker.address, "tiny", "mooncake")
        await writer.register()
        pool = await writer.pool()
        async with grpc.aio.insecure_channel(dit.address) as channel:
            stub = dit_pb2_grpc.DitServiceStub(channel)
            for forgery in ("outside_the_pool", "other_pages", "write_named_twice",
                            "a_source_rank_the_heads_do_not_split_into", "pages_outside_the_pool"):
                t = await writer.written_ticket([5], seed=6)
                plan = plan_to_proto(core.plan_for(t.ticket_id))
                layout = PageLayout(geometry_from_proto(plan.dit_geometry), 1, 0)
                _forge_writes(plan, forgery, layout.page_bytes, layout.pool_bytes(plan.dit_num_pages))
                request = dit_pb2.DenoiseRequest(ticket_id=t.ticket_id, width=64, height=64,
                                                 num_inference_steps=1, guidance_scale=1.0, seed=0, plan=plan)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _collect(stub, request, timeout=30.0)
                assert reason_of(info.value)[:2] == ("FAILED_PRECONDITION", "PLAN_MISMATCH"), (
                    forgery, info.value)
                if forgery == "pages_outside_the_pool":
                    assert "outside the pool" in (info.value.details() or ""), info.value.details()
                ended = await _wait_ticket(writer, t.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
                assert ended.state == broker_pb2.TICKET_STATE_RELEASED, (forgery, ended)
            # A deadline_time outside Timestamp's range: INVALID_ARGUMENT naming it (was
            # UNKNOWN, a ValueError from Timestamp.ToNanoseconds()).
            t = await writer.written_ticket([5], seed=6)
            for stamp in (Timestamp(seconds=2**62), Timestamp(seconds=10**9, nanos=-5)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _collect(stub, dit_pb2.DenoiseRequest(
                        ticket_id=t.ticket_id, width=64, height=64, num_inference_steps=1,
                        guidance_scale=1.0, seed=0, plan=plan_to_proto(core.plan_for(t.ticket_id)),
                        deadline_time=stamp), timeout=30.0)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
                assert (info.value.details() or "").startswith("deadline_time:"), info.value.details()
            # Bad input leaves the ticket untouched (dit_service.md): its caller ends it.
            await writer.stub.CancelTicket(broker_pb2.CancelTicketRequest(
                ticket_id=t.ticket_id, outcome=broker_pb2.TICKET_OUTCOME_CANCELLED, reason="test"), timeout=5.0)
            t = await writer.written_ticket([5], seed=6)
            events = await _collect(stub, dit_pb2.DenoiseRequest(
                ticket_id=t.ticket_id, width=64, height=64, num_inference_steps=1, guidance_scale=1.0,
                seed=0, plan=plan_to_proto(core.plan_for(t.ticket_id))), timeout=30.0)
            assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
        await _wait_ticket(writer, t.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
        for _ in range(100):
            if (await writer.pool()).free_pages == pool.total_pages:
                break
            await asyncio.sleep(0.05)
        assert (await writer.pool()).free_pages == pool.total_pages
        await writer.close()

    replica.run(scenario())


def test_a_broker_that_does_not_answer_start_consuming_is_broker_unavailable(tmp_path: Path) -> None:
    """StartConsuming refused UNAVAILABLE on every try (the broker stopped or restarting) ends
    Denoise UNAVAILABLE / BROKER_UNAVAILABLE naming the call, as every other broker call the DiT
    makes: before, it was ABORTED / TICKET_ENDED ("the ticket ended elsewhere"), which a
    generation then carried although nothing had ended it (found black-box: a SIGSTOPped broker
    failed 2 of 6 generations so)."""
    from kvrelay.broker.service import BrokerServicer
    from kvrelay.broker.tickets import TicketState

    config = write_config(tmp_path, transport="mooncake")
    refused: list[str] = []

    class Unanswering(BrokerServicer):
        async def StartConsuming(self, request: Any, context: Any) -> Any:  # noqa: N802
            refused.append(request.ticket_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the broker is restarting")

    async def scenario() -> None:
        async with inprocess_broker(servicer_class=Unanswering) as (broker, core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                ticket = await writer.written_ticket([5], seed=6)
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await _collect(dit_pb2_grpc.DitServiceStub(channel), dit_pb2.DenoiseRequest(
                            ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=2,
                            guidance_scale=1.0, seed=0))
                assert refused and set(refused) == {ticket.ticket_id}
                assert reason_of(info.value)[:2] == ("UNAVAILABLE", "BROKER_UNAVAILABLE"), info.value
                assert "StartConsuming" in (info.value.details() or "")
                released = await _wait_ticket(writer, ticket.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
                assert released.state == broker_pb2.TICKET_STATE_RELEASED
                assert core.get_ticket(ticket.ticket_id).state is TicketState.RELEASED
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())


def test_a_broker_silent_past_the_transfer_timeout_is_asked_before_the_transfer_is_blamed(tmp_path: Path) -> None:
    """The load's budget spent with no word from the broker (its WatchTicket stream stalls, as a
    SIGSTOPped broker's does) is not a TRANSFER_TIMEOUT until the broker answers one GetTicket:
    answered with the writes done, the request loads and succeeds; unanswered, it fails
    UNAVAILABLE / BROKER_UNAVAILABLE. Before, both failed DEADLINE_EXCEEDED / TRANSFER_TIMEOUT
    and the broker marked the sound AR -> DiT link suspect (found black-box: a broker SIGSTOPped
    for 20 s under kvrelay up failed 4 of 8 generations so, their writes done and reported
    within 0.2 s)."""
    from kvrelay.broker.service import BrokerServicer
    from kvrelay.security import current_caller

    config = write_config(tmp_path, transport="mooncake", transfer_timeout=3.0)
    watching = asyncio.Event()
    silent_to: set[str] = set()  # tickets whose GetTicket (after the first) the DiT gets no answer to
    asked: dict[str, int] = {}

    class Stalling(BrokerServicer):
        def _from_dit(self) -> bool:
            caller = current_caller()
            return caller is not None and caller.replica_id == "dit-0"

        async def WatchTicket(self, request: Any, context: Any) -> Any:  # noqa: N802
            if self._from_dit():
                watching.set()
                await asyncio.sleep(3600)  # until the DiT's deadline cancels it
            async for reply in super().WatchTicket(request, context):
                yield reply

        async def GetTicket(self, request: Any, context: Any) -> Any:  # noqa: N802
            if self._from_dit():
                asked[request.ticket_id] = asked.get(request.ticket_id, 0) + 1
                if request.ticket_id in silent_to and asked[request.ticket_id] > 1:
                    await asyncio.sleep(3600)
            return await super().GetTicket(request, context)

    async def denoise(stub: dit_pb2_grpc.DitServiceStub, writer: ArWriter, counts: list[int],
                      silent: bool) -> list[dit_pb2.DenoiseEvent]:
        ticket = await writer.create_ticket(counts)
        armed = await writer.arm(ticket.ticket_id)
        if silent:
            silent_to.add(ticket.ticket_id)
        watching.clear()
        call = asyncio.ensure_future(_collect(stub, dit_pb2.DenoiseRequest(
            ticket_id=ticket.ticket_id, width=64, height=64, num_inference_steps=2, guidance_scale=1.0, seed=0)))
        await asyncio.wait_for(watching.wait(), 30.0)
        # Written and reported while the DiT hears nothing from the broker.
        await writer.report(ticket.ticket_id, await asyncio.to_thread(writer.write, armed, writer.rows_kv(counts, 3)))
        try:
            return await call
        finally:
            assert asked[ticket.ticket_id] == 2, asked  # Denoise's own, then the one at the budget's end

    async def scenario() -> None:
        async with inprocess_broker(servicer_class=Stalling) as (broker, core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    stub = dit_pb2_grpc.DitServiceStub(channel)
                    events = await denoise(stub, writer, [5], silent=False)
                    assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED and events[-1].image.png
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await denoise(stub, writer, [6], silent=True)
                assert reason_of(info.value)[:2] == ("UNAVAILABLE", "BROKER_UNAVAILABLE"), info.value
                assert "the broker does not answer" in (info.value.details() or "")
                for _ in range(200):
                    pool = await writer.pool()
                    if pool.free_pages == pool.total_pages:
                        break
                    await asyncio.sleep(0.05)
                assert pool.free_pages == pool.total_pages, pool
                await writer.close()
            finally:
                assert await asyncio.to_thread(dit.stop) == 0, "".join(dit.lines[-30:])

    asyncio.run(scenario())
