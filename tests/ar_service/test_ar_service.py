"""The AR service end to end: a real `python -m kvrelay ar` process, a real broker (a `python -m
kvrelay broker` process, or BrokerCore in-process where the test drives the core directly) and a
receiver whose pages the test reads back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kvrelay.errors import reason_of
from kvrelay.models.ar import build_ar_model
from kvrelay.models.tokenizer import ByteTokenizer
from kvrelay.v1 import ar_pb2, broker_pb2, common_pb2
from kvrelay.worker import default_threads_per_rank
from tests.ar_service.harness import Receiver, ar_stub, broker_process, start_ar, wait_serving, write_config
from tests.dit_service.harness import inprocess_broker
from tests.threads import torch_threads

pytestmark = pytest.mark.slow

PROMPT = "a red fox in the snow, watercolor, soft morning light"
NEGATIVE = "blurry"


def _local_kv(text: str, heads: slice = slice(None)) -> torch.Tensor:
    """A local prefill with the thread count the AR's rank runs with: the promise under test is
    the AR's own bits, moved unchanged."""
    ids = ByteTokenizer().encode(text)
    with torch_threads(default_threads_per_rank(1)):
        return build_ar_model(preset="tiny", seed=0).prefill(ids)[:, :, heads]


async def _prefill(
    address: str, request: ar_pb2.PrefillRequest, timeout: float = 60.0
) -> ar_pb2.PrefillResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await ar_stub(channel).Prefill(request, timeout=timeout)


@pytest.mark.parametrize("transport", ["mooncake", "grpc"])
def test_prefill_writes_two_rows_bit_for_bit_and_reports_every_write(tmp_path: Path, transport: str) -> None:
    # A lease long enough that the receiver (which does not heartbeat) stays up for the test.
    config = write_config(tmp_path, transport=transport, lease_seconds=60.0)

    async def scenario() -> None:
        async with broker_process(config, cwd=tmp_path) as broker_address:
            receiver = Receiver(
                broker_address, preset="tiny", transport=transport, world_size=1, num_pages=32
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker_address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                tok = ByteTokenizer()
                counts = [len(tok.encode(PROMPT)), len(tok.encode(NEGATIVE))]
                async with grpc.aio.insecure_channel(ar.address) as channel:
                    tokenized = await ar_stub(channel).Tokenize(
                        ar_pb2.TokenizeRequest(texts=[PROMPT, NEGATIVE]), timeout=10.0
                    )
                assert list(tokenized.token_counts) == counts and tokenized.max_tokens == 256
                ticket = await receiver.create_ticket(counts)
                reply = await _prefill(
                    ar.address,
                    ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, request_id=ticket.request_id,
                                          rows=[PROMPT, NEGATIVE], seed=5),
                )  # fmt: skip
                assert list(reply.token_counts) == counts
                assert reply.prefill_seconds > 0 and reply.transfer_seconds > 0
                after = await receiver.ticket(ticket.ticket_id)
                # Armed by the AR, every write reported OK with its checksum and size.
                assert after.armed and after.state == broker_pb2.TICKET_STATE_WRITING
                assert len(after.writes) == 2
                assert all(w.status == common_pb2.WRITE_STATUS_OK and w.checksum for w in after.writes)
                layout = receiver.layouts[0]
                whole_pages = sum(len(r.page_ids) for r in after.rows) * layout.page_bytes
                assert reply.bytes_written == sum(w.bytes for w in after.writes) == whole_pages
                for row, text in enumerate([PROMPT, NEGATIVE]):
                    got = receiver.row(0, after, row)
                    assert torch.equal(got, _local_kv(text)), f"row {row} differs from a local prefill"
                    # The tail of the last page is zero padding, not stale memory.
                    spec = next(r for r in after.rows if r.row == row)
                    used = spec.num_tokens % receiver.geometry.page_size
                    if used:
                        last = receiver.page_bytes(0, [spec.page_ids[-1]])[0]
                        pages = last.view(torch.float32).view(
                            receiver.geometry.num_layers,
                            2,
                            layout.heads_per_shard,
                            receiver.geometry.page_size,
                            -1,
                        )
                        assert torch.count_nonzero(pages[:, :, :, used:]) == 0
                # The DiT's side of the lifecycle (load, release) frees every page.
                for row in (0, 1):
                    verified = [
                        broker_pb2.WriteProgress(row=w.row, src_rank=w.src_rank, dst_rank=w.dst_rank,
                                                 status=w.status, checksum=w.checksum, bytes=w.bytes)
                        for w in after.writes if w.row == row
                    ]  # fmt: skip
                    await receiver.stub.ReportLoad(
                        broker_pb2.ReportLoadRequest(ticket_id=ticket.ticket_id, row=row, dst_rank=0,
                                                     replica_id="dit-0", incarnation_id=receiver.incarnation_id,
                                                     verified=verified),
                        timeout=5.0,
                    )  # fmt: skip
                assert (await receiver.ticket(ticket.ticket_id)).state == broker_pb2.TICKET_STATE_READY
                await receiver.stub.ReleaseTicket(
                    broker_pb2.ReleaseTicketRequest(ticket_id=ticket.ticket_id,
                                                    outcome=broker_pb2.TICKET_OUTCOME_OK, replica_id="dit-0",
                                                    incarnation_id=receiver.incarnation_id),
                    timeout=5.0,
                )  # fmt: skip
                pool = await receiver.pool()
                assert pool.free_pages == pool.total_pages
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                await receiver.close()

    asyncio.run(scenario())


def test_bad_input_fails_cleanly_and_leaves_no_ticket(tmp_path: Path) -> None:
    # A lease long enough that the receiver (which does not heartbeat) stays up for the test.
    config = write_config(tmp_path, transport="mooncake", lease_seconds=60.0)

    async def scenario() -> None:
        async with broker_process(config, cwd=tmp_path) as broker_address:
            receiver = Receiver(
                broker_address, preset="tiny", transport="mooncake", world_size=1, num_pages=32
            )
            await receiver.start()
            ar = await asyncio.to_thread(start_ar, config, broker_address, cwd=tmp_path)
            try:
                await wait_serving(ar.address)
                # Too long: tiny takes 256 tokens; the byte tokenizer adds BOS to 300 bytes.
                ticket = await receiver.create_ticket([12])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _prefill(
                        ar.address, ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=["x" * 300])
                    )
                code, reason, message = reason_of(err.value)
                assert (code, reason) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT")
                assert "rows[0]" in message and "301 tokens" in message and "256" in message
                # The unarmed ticket was rolled back: no ticket, no pages left behind.
                gone = await receiver.ticket(ticket.ticket_id)
                assert gone.state == broker_pb2.TICKET_STATE_RELEASED and not gone.armed
                pool = await receiver.pool()
                assert pool.free_pages == pool.total_pages

                # Unknown ticket: the broker's NOT_FOUND and reason, passed through.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _prefill(ar.address, ar_pb2.PrefillRequest(ticket_id="nope", rows=[PROMPT]))
                assert reason_of(err.value)[:2] == ("NOT_FOUND", "UNKNOWN_TICKET")

                # A ticket bound to another AR replica: FAILED_PRECONDITION, and that ticket untouched.
                ar0 = next(
                    r
                    for r in (
                        await receiver.stub.ListReplicas(broker_pb2.ListReplicasRequest(), timeout=5.0)
                    ).replicas
                    if r.replica_id == "ar-0"
                )
                ar1 = broker_pb2.ReplicaInfo()
                ar1.CopyFrom(ar0)
                ar1.replica_id, ar1.incarnation_id = "ar-1", "other-incarnation"
                await receiver.stub.RegisterReplica(
                    broker_pb2.RegisterReplicaRequest(replica=ar1), timeout=5.0
                )
                foreign = await receiver.create_ticket(
                    [len(ByteTokenizer().encode(PROMPT))], ar_replica_id="ar-1"
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _prefill(
                        ar.address, ar_pb2.PrefillRequest(ticket_id=foreign.ticket_id, rows=[PROMPT])
                    )
                assert reason_of(err.value)[:2] == ("FAILED_PRECONDITION", "WRONG_REPLICA")
                still = await receiver.ticket(foreign.ticket_id)
                assert still.state == broker_pb2.TICKET_STATE_RESERVED and not still.armed

                # Row count that differs from the reservation: INVALID_ARGUMENT naming rows, rolled back.
                ticket = await receiver.create_ticket([5])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _prefill(
                        ar.address, ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[PROMPT])
                    )
                assert reason_of(err.value)[0] == "INVALID_ARGUMENT" and "rows" in reason_of(err.value)[2]
                assert (await receiver.ticket(ticket.ticket_id)).state == broker_pb2.TICKET_STATE_RELEASED

                # The replica still serves after all of that.
                counts = [len(ByteTokenizer().encode(PROMPT))]
                ok = await receiver.create_ticket(counts)
                reply = await _prefill(
                    ar.address, ar_pb2.PrefillRequest(ticket_id=ok.ticket_id, rows=[PROMPT])
                )
                assert list(reply.token_counts) == counts and reply.bytes_written > 0
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                await receiver.close()

    asyncio.run(scenario())


def test_real_dit_denoises_over_what_the_ar_wrote(tmp_path: Path) -> None:
    """The AR process and the DiT process (issue 7) through the broker: Denoise waits for the AR's
    writes, verifies them, and draws the image a local AR prefill + DiT would draw."""
    import numpy as np

    from kvrelay.models.dit import DitRunner
    from kvrelay.models.image import decode_png
    from kvrelay.v1 import dit_pb2, dit_pb2_grpc
    from tests.dit_service.harness import start_dit

    config = write_config(tmp_path, transport="mooncake")

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            dit = await asyncio.to_thread(start_dit, config, broker.address, cwd=tmp_path)
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit.address)
                await wait_serving(ar.address)
                tok = ByteTokenizer()
                counts = [len(tok.encode(PROMPT)), len(tok.encode(NEGATIVE))]
                ticket = core.create_ticket("req-1", "ar-0", "dit-0", counts)
                assert ticket is not None
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    request = dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, request_id="req-1", width=64, height=64,
                        num_inference_steps=2, guidance_scale=2.0, seed=3,
                    )  # fmt: skip

                    async def collect() -> list[dit_pb2.DenoiseEvent]:
                        stub = dit_pb2_grpc.DitServiceStub(channel)  # type: ignore[no-untyped-call]
                        return [e async for e in stub.Denoise(request, timeout=60.0)]

                    denoise = asyncio.ensure_future(collect())
                    reply = await _prefill(
                        ar.address, ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[PROMPT, NEGATIVE])
                    )
                    events = await denoise
                final = events[-1]
                assert final.phase == dit_pb2.DENOISE_PHASE_DECODED
                assert final.bytes_loaded == reply.bytes_written > 0
                prefixes = []
                for text in (PROMPT, NEGATIVE):
                    kv = _local_kv(text)
                    prefixes.append([(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])])
                local = DitRunner("tiny").generate(
                    prefixes, width=64, height=64, steps=2, guidance_scale=2.0, seed=3
                )
                image = decode_png(final.image.png)
                # Thread counts may round the DiT's matmuls differently; the prefix itself is exact.
                assert int(np.abs(image.astype(int) - local.numpy().astype(int)).max()) <= 1
                for _ in range(100):
                    done = core.get_ticket(ticket.ticket_id)
                    if done.state.value == "RELEASED":
                        break
                    await asyncio.sleep(0.05)
                assert (done.state.value, done.outcome.value if done.outcome else None) == ("RELEASED", "OK")
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                dit.stop()

    asyncio.run(scenario())


def test_sent_and_received_bytes_are_counted_per_rank(tmp_path: Path) -> None:
    """AR TP=2 -> DiT TP=2 over Mooncake: each AR rank's `kvrelay_ar_sent_bytes_total{outcome=ok}`
    and each DiT rank's `kvrelay_dit_received_bytes_total` equal the bytes of the plan's writes
    from / to that rank."""
    from kvrelay.v1 import dit_pb2, dit_pb2_grpc
    from tests.dit_service.harness import start_dit
    from tests.procs import scrape_counter_by_labels

    config = write_config(tmp_path, transport="mooncake", ar_tp=2, dit_tp=2)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            dit = await asyncio.to_thread(start_dit, config, broker.address, cwd=tmp_path)
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit.address)
                await wait_serving(ar.address)
                tok = ByteTokenizer()
                counts = [len(tok.encode(PROMPT)), len(tok.encode(NEGATIVE))]
                ticket = core.create_ticket("req-1", "ar-0", "dit-0", counts)
                assert ticket is not None
                plan = core.plan_for(ticket.ticket_id).writes
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    request = dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, request_id="req-1", width=64, height=64,
                        num_inference_steps=1, guidance_scale=2.0, seed=3,
                    )  # fmt: skip
                    stub = dit_pb2_grpc.DitServiceStub(channel)  # type: ignore[no-untyped-call]
                    denoise = asyncio.ensure_future(_collect_events(stub, request))
                    reply = await _prefill(
                        ar.address, ar_pb2.PrefillRequest(ticket_id=ticket.ticket_id, rows=[PROMPT, NEGATIVE])
                    )
                    events = await denoise
                assert events[-1].phase == dit_pb2.DENOISE_PHASE_DECODED
                assert reply.bytes_written == sum(w.num_bytes for w in plan) > 0
                sent_by_rank = {r: sum(w.num_bytes for w in plan if w.src_rank == r) for r in (0, 1)}
                received_by_rank = {r: sum(w.num_bytes for w in plan if w.dst_rank == r) for r in (0, 1)}
                assert all(sent_by_rank.values()) and all(received_by_rank.values())
                ar_port, dit_port = ar.metrics_port(), dit.metrics_port()
                assert ar_port is not None and dit_port is not None
                sent = scrape_counter_by_labels(ar_port, "kvrelay_ar_sent_bytes", ["rank", "transport", "outcome"])
                assert sent == {(str(r), "mooncake", "ok"): float(b) for r, b in sent_by_rank.items()}
                received = scrape_counter_by_labels(dit_port, "kvrelay_dit_received_bytes", ["rank", "transport"])
                assert received == {(str(r), "mooncake"): float(b) for r, b in received_by_rank.items()}
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                dit.stop()

    asyncio.run(scenario())


async def _collect_events(stub: Any, request: Any) -> list[Any]:
    return [e async for e in stub.Denoise(request, timeout=60.0)]


def test_prefill_and_denoise_under_a_deadline_past_2262_succeed(tmp_path: Path) -> None:
    """The AR's Prefill and the DiT's Denoise called straight (not through the broker) with a gRPC
    deadline gRPC cannot pass on (`grpcurl -max-time 8e9`, past 2262; a Go client's "no
    deadline"): each holds it to MAX_DEADLINE_SECONDS (kvrelay.errors.request_budget) for its own
    calls and waits, and both succeed; the broker's side: tests/orchestrator/test_far_deadline.py."""
    import json
    import subprocess

    from tests.dit_service.harness import start_dit
    from tests.orchestrator.test_far_deadline import _grpcurl, _messages

    config = write_config(tmp_path, transport="mooncake")

    def far(address: str, method: str, request: dict[str, Any]) -> list[dict[str, Any]]:
        done = subprocess.run(
            [_grpcurl(), "-plaintext", "-max-time", "8e9", "-d", json.dumps(request), address, method],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, f"{method}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
        return [json.loads(m) for m in _messages(done.stdout)]

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=60.0) as (broker, core):
            dit = await asyncio.to_thread(start_dit, config, broker.address, cwd=tmp_path)
            ar = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit.address)
                await wait_serving(ar.address)
                tok = ByteTokenizer()
                counts = [len(tok.encode(PROMPT)), len(tok.encode(NEGATIVE))]
                ticket = core.create_ticket("req-far", "ar-0", "dit-0", counts)
                assert ticket is not None
                denoise = asyncio.ensure_future(asyncio.to_thread(
                    far, dit.address, "kvrelay.v1.DitService/Denoise",
                    {"ticket_id": ticket.ticket_id, "request_id": "req-far", "width": 64, "height": 64,
                     "num_inference_steps": 1, "guidance_scale": 2.0, "seed": 3},
                ))  # fmt: skip
                (reply,) = await asyncio.to_thread(
                    far, ar.address, "kvrelay.v1.ArService/Prefill",
                    {"ticket_id": ticket.ticket_id, "request_id": "req-far", "rows": [PROMPT, NEGATIVE]},
                )
                events = await denoise
                assert [int(c) for c in reply["token_counts"]] == counts and int(reply["bytes_written"]) > 0
                assert events[-1]["phase"] == "DENOISE_PHASE_DECODED", events[-1].get("phase")
                assert int(events[-1]["bytes_loaded"]) == int(reply["bytes_written"])
                for _ in range(200):
                    done = core.get_ticket(ticket.ticket_id)
                    if done.state.value == "RELEASED":
                        break
                    await asyncio.sleep(0.05)
                assert (done.state.value, done.outcome.value if done.outcome else None) == ("RELEASED", "OK")
                assert ar.stop() == 0, ar.output()
            finally:
                ar.stop()
                dit.stop()

    asyncio.run(scenario())
