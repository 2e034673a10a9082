"""`kvrelay dit`: a second signal cuts the graceful drain. A real DiT runs a long Denoise (ticket
A) while ticket B waits with its write in doubt; SIGTERM starts the drain (5 s of grace for the
Denoise, then its ranks are stopped within a step); SIGTERM again: the ranks are killed at once,
the process exits EXIT_FAST_STOP and its pools are freed. To the broker it is a crash: A is
released only as not OK (after the kill, nothing reads its pages), B stays held, and the next
incarnation ends both with every page free (its replica lock also proves no rank is left)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvrelay.stopping import EXIT_FAST_STOP
from kvrelay.transfer.convert import writes_from_proto
from kvrelay.transfer.transport import WriteOutcome
from kvrelay.v1 import broker_pb2, dit_pb2, dit_pb2_grpc
from tests.dit_service.harness import ArWriter, inprocess_broker, start_dit, wait_serving, write_config
from tests.foundation.test_stop_while_starting import _printed, _wait_for_event

pytestmark = pytest.mark.slow

# Under the graceful stop's 5 s grace for the Denoise alone, generous for a loaded 2-core runner.
EXIT_WITHIN_S = 10.0


async def _wait_ticket(writer: ArWriter, ticket_id: str, state: int, timeout: float) -> broker_pb2.Ticket:
    deadline = time.monotonic() + timeout
    while True:
        ticket = await writer.ticket(ticket_id)
        if ticket.state == state or time.monotonic() > deadline:
            return ticket
        await asyncio.sleep(0.05)


def test_a_second_sigterm_kills_the_denoise_and_leaves_the_pages_to_the_broker(tmp_path: Path) -> None:
    config = write_config(tmp_path, transport="mooncake", max_num_seqs=2)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            again = None
            try:
                await wait_serving(dit)
                writer = ArWriter(broker.address, "tiny", "mooncake")
                await writer.register()
                a = await writer.written_ticket([10], seed=0)
                b = await writer.create_ticket([12])
                armed_b = await writer.arm(b.ticket_id)
                b_pages = sum(len(r.page_ids) for r in armed_b.ticket.rows)
                await writer.report(b.ticket_id, [
                    WriteOutcome(w.row, w.src_rank, w.dst_rank, "IN_DOUBT", 0, 0, "test: still in flight")
                    for w in writes_from_proto(armed_b.writes)
                ])
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    call = dit_pb2_grpc.DitServiceStub(channel).Denoise(dit_pb2.DenoiseRequest(
                        ticket_id=a.ticket_id, width=512, height=512, num_inference_steps=1000,
                        guidance_scale=1.0, seed=0), timeout=60.0)
                    while (await call.read()).phase != dit_pb2.DENOISE_PHASE_STEP:
                        pass
                    dit.proc.send_signal(signal.SIGTERM)
                    await asyncio.to_thread(_wait_for_event, dit.lines, "stop_requested", dit.proc, 10.0)
                    dit.proc.send_signal(signal.SIGTERM)
                    try:
                        code = await asyncio.to_thread(dit.proc.wait, EXIT_WITHIN_S)
                    except subprocess.TimeoutExpired:
                        raise AssertionError("the DiT still drains after a second SIGTERM:\n"
                                             + "".join(dit.lines[-40:])) from None
                    with pytest.raises(grpc.aio.AioRpcError):
                        while await call.read() is not grpc.aio.EOF:
                            pass
                assert code == EXIT_FAST_STOP, "".join(dit.lines[-40:])
                assert any("SIGTERM again: fast stop" in line for line in _printed(dit.lines))
                assert list(Path("/dev/shm").glob(f"kvrelay-dit-0-{dit.proc.pid}-*")) == []

                # A: released only as not OK, or left CONSUMING for the next incarnation.
                a_now = await writer.ticket(a.ticket_id)
                if a_now.state == broker_pb2.TICKET_STATE_RELEASED:
                    assert a_now.outcome != broker_pb2.TICKET_OUTCOME_OK
                # B's write is in doubt: its pages stay held, past the quiet period too.
                await asyncio.sleep(0.5)
                b_now = await writer.ticket(b.ticket_id)
                assert b_now.state != broker_pb2.TICKET_STATE_RELEASED
                pool = await writer.pool()
                assert pool.free_pages <= pool.total_pages - b_pages
                assert pool.free_pages + pool.reserved_pages + pool.draining_pages == pool.total_pages

                # The next incarnation takes the replica lock (no rank of the old one is alive)
                # and registers: every ticket of the old memory ends, every page is free.
                again = await asyncio.to_thread(start_dit, config, broker.address, cwd=tmp_path)
                await wait_serving(again)
                for t in (a, b):
                    ended = await _wait_ticket(writer, t.ticket_id, broker_pb2.TICKET_STATE_RELEASED, 10.0)
                    assert ended.state == broker_pb2.TICKET_STATE_RELEASED, ended
                pool = await writer.pool()
                assert (pool.free_pages, pool.reserved_pages, pool.draining_pages) == (pool.total_pages, 0, 0)
                await writer.close()
                assert await asyncio.to_thread(again.stop) == 0, "".join(again.lines[-30:])
            finally:
                await asyncio.to_thread(dit.stop)
                if again is not None:
                    await asyncio.to_thread(again.stop)

    asyncio.run(scenario())
