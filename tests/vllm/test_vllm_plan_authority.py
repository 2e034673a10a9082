"""A vLLM-served AR writes only where the broker's arming reply says, as the built-in AR does
(tests/ar_service/test_plan_authority.py): a Prefill whose plan points the writes at another live
ticket's pages, or at pages no ticket holds, is refused FAILED_PRECONDITION / PLAN_MISMATCH before
the KvRelayConnector in vLLM's worker moves a byte, every write of the ticket is reported
NOT_STARTED, and vLLM gets the rows' KV blocks back (the cache here has room for one ticket only:
a block kept by a refused ticket would fail the next prefill). The genuine plan still writes.

Real broker (BrokerCore behind the gRPC servicer), a real `kvrelay ar` process with `engine: vllm`
(a tiny random Llama checkpoint shaped like the `small` preset), a receiver whose pages the test
reads back; Mooncake (TCP) and the gRPC fallback.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
import yaml

pytest.importorskip("vllm", reason="engine: vllm needs vLLM (scripts/setup.sh --vllm)")

from kvrelay.errors import reason_of  # noqa: E402
from kvrelay.models.ar import build_ar_model  # noqa: E402
from kvrelay.v1 import ar_pb2, broker_pb2, common_pb2  # noqa: E402
from tests.ar_service.harness import Receiver, ar_stub, start_ar, wait_serving, write_config  # noqa: E402
from tests.ar_service.test_plan_authority import _forge, _wait_state  # noqa: E402
from tests.dit_service.harness import inprocess_broker  # noqa: E402
from tests.vllm.checkpoint import build_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "a red fox in the snow, watercolor, soft morning light"


@pytest.mark.parametrize("transport", ["mooncake", "grpc"])
def test_a_forged_plan_never_makes_the_vllm_connector_write(tmp_path: Path, transport: str) -> None:
    from kvrelay.ar_service.vllm_engine import VllmTokenizer
    from kvrelay.broker.service import plan_to_proto

    checkpoint = build_checkpoint(tmp_path / "llama", arch="llama", seed=3)
    config = write_config(tmp_path, transport=transport, preset="small")
    cfg = yaml.safe_load(config.read_text())
    ar = cfg["stages"][0]
    # One usable KV block of 128 tokens (vLLM's block 0 is its null block): one ticket's row at a time.
    ar["model"] = {"engine": "vllm", "path": str(checkpoint),
                   "vllm_args": {"max_model_len": 128, "num_gpu_blocks_override": 2}}  # fmt: skip
    ar["request_timeout_seconds"] = 120
    config.write_text(yaml.safe_dump(cfg))
    ids = VllmTokenizer(str(checkpoint)).encode(PROMPT)

    async def scenario() -> None:
        async with inprocess_broker(lease_seconds=120.0) as (broker, core):
            receiver = Receiver(broker.address, preset="small", transport=transport, world_size=1, num_pages=32)
            await receiver.start()
            proc = await asyncio.to_thread(start_ar, config, broker.address, cwd=tmp_path, timeout=240.0)
            try:
                await wait_serving(proc.address, timeout=240.0)
                page_bytes = receiver.layouts[0].page_bytes
                for forgery in ("other_ticket_pages", "unowned_pages"):
                    victim = await receiver.create_ticket([len(ids)])
                    caller = await receiver.create_ticket([len(ids)])
                    owned = set(victim.rows[0].page_ids) | set(caller.rows[0].page_ids)
                    free_page = max(owned) + 4
                    assert free_page + len(caller.rows[0].page_ids) <= receiver.num_pages
                    before = receiver.regions[0].clone()
                    forged = _forge(
                        plan_to_proto(core.plan_for(caller.ticket_id)),
                        plan_to_proto(core.plan_for(victim.ticket_id)),
                        forgery, page_bytes, free_page,
                    )  # fmt: skip
                    refusal: grpc.aio.AioRpcError | None = None
                    async with grpc.aio.insecure_channel(proc.address) as channel:
                        try:
                            await ar_stub(channel).Prefill(
                                ar_pb2.PrefillRequest(ticket_id=caller.ticket_id, request_id=caller.request_id,
                                                      rows=[PROMPT], seed=1, plan=forged),
                                timeout=120.0,
                            )  # fmt: skip
                        except grpc.aio.AioRpcError as err:
                            refusal = err
                    changed = sorted({i // page_bytes
                                      for i in torch.nonzero(receiver.regions[0] != before).flatten().tolist()})
                    assert not changed, f"{forgery}: vLLM's connector wrote into pages {changed}"
                    assert refusal is not None, f"{forgery}: the forged plan was served"
                    assert reason_of(refusal)[:2] == ("FAILED_PRECONDITION", "PLAN_MISMATCH"), refusal
                    refused = await receiver.ticket(caller.ticket_id)
                    assert refused.armed and refused.writes
                    assert all(w.status == common_pb2.WRITE_STATUS_NOT_STARTED for w in refused.writes), refused
                    untouched = await receiver.ticket(victim.ticket_id)
                    assert untouched.state == broker_pb2.TICKET_STATE_RESERVED and not untouched.armed

                    # The genuine plan writes the victim's own pages, and only those: its prefill
                    # fits vLLM's one block only if the refused ticket gave its block back.
                    async with grpc.aio.insecure_channel(proc.address) as channel:
                        reply = await ar_stub(channel).Prefill(
                            ar_pb2.PrefillRequest(ticket_id=victim.ticket_id, request_id=victim.request_id,
                                                  rows=[PROMPT], seed=1,
                                                  plan=plan_to_proto(core.plan_for(victim.ticket_id))),
                            timeout=120.0,
                        )  # fmt: skip
                    assert reply.bytes_written == len(victim.rows[0].page_ids) * page_bytes
                    written = await receiver.ticket(victim.ticket_id)
                    assert all(w.status == common_pb2.WRITE_STATUS_OK for w in written.writes), written
                    reference = await asyncio.to_thread(
                        lambda: build_ar_model(path=checkpoint, dtype="float32").prefill(list(ids))
                    )
                    torch.testing.assert_close(receiver.row(0, written, 0), reference, rtol=1e-4, atol=1e-4)
                    mask = torch.ones_like(before, dtype=torch.bool)
                    for p in victim.rows[0].page_ids:
                        mask[p * page_bytes : (p + 1) * page_bytes] = False
                    assert torch.equal(receiver.regions[0][mask], before[mask]), "bytes outside the ticket's pages"
                    for t in (caller, victim):
                        await receiver.stub.CancelTicket(
                            broker_pb2.CancelTicketRequest(ticket_id=t.ticket_id,
                                                           outcome=broker_pb2.TICKET_OUTCOME_CANCELLED, reason="test"),
                            timeout=5.0,
                        )  # fmt: skip
                        ended = await _wait_state(receiver, t.ticket_id, broker_pb2.TICKET_STATE_RELEASED)
                        assert ended.state == broker_pb2.TICKET_STATE_RELEASED, ended
                pool = await receiver.pool()
                assert pool.free_pages == pool.total_pages, pool
                assert "plan_mismatch" in proc.output()
                assert await asyncio.to_thread(proc.stop) == 0, proc.output()
            finally:
                await asyncio.to_thread(proc.stop)
                await receiver.close()

    asyncio.run(scenario())
