"""A request whose rows can never be held in a vLLM AR's whole KV cache at once is refused when
the AR validates it (INVALID_ARGUMENT NEVER_FITS, naming the numbers and the fix), not after its
turn on the engine as INTERNAL PREFILL_FAILED ("VllmCacheFull ... raise VLLM_CPU_KVCACHE_SPACE",
which read as a server fault and named the variable even where kv_cache_memory_bytes sized the
cache). The AR service's validation alone: no engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvrelay.ar_service.batcher import PrefillBatcher
from kvrelay.ar_service.service import ArMetrics, ArReplicaState, ArServicer
from kvrelay.errors import KvRelayServerError
from kvrelay.models.tokenizer import ByteTokenizer
from kvrelay.v1 import ar_pb2


def _state(cache_blocks: int, block_size: int = 128) -> ArReplicaState:
    return ArReplicaState(
        replica_id="ar-0", incarnation_id="inc-1", group=None, tokenizer=ByteTokenizer(),  # type: ignore[arg-type]
        max_tokens=1023, vocab=ByteTokenizer.vocab_size, tensor_parallel_size=1, transport="mooncake",
        transfer_timeout_s=5.0, request_timeout_s=30.0, cache_blocks=cache_blocks, cache_block_size=block_size,
    )  # fmt: skip


def _validate(state: ArReplicaState, *rows: str) -> list[list[int]]:
    servicer = ArServicer(None, ArMetrics.create(CollectorRegistry()), lambda reason: None)
    return servicer._validate(ar_pb2.PrefillRequest(ticket_id="t", rows=list(rows)), state)


def test_rows_larger_than_vllms_whole_cache_never_fit() -> None:
    # 1000 tokens (BOS + 999 bytes) = 8 blocks of 128 per row: 16 > 11.
    with pytest.raises(KvRelayServerError) as info:
        _validate(_state(11), "y" * 999, "z" * 999)
    err = info.value
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "NEVER_FITS")
    assert "need 16 KV blocks of 128 tokens at once; the vLLM AR's whole KV cache has 11" in str(err)
    assert "VLLM_CPU_KVCACHE_SPACE or model.vllm_args.kv_cache_memory_bytes" in str(err)
    # Exactly the whole cache fits (5 + 6 blocks at the block boundaries), and no bound: anything.
    assert [len(r) for r in _validate(_state(11), "y" * 639, "z" * 767)] == [640, 768]
    assert len(_validate(_state(0), "y" * 999, "z" * 999)) == 2


@dataclass(frozen=True)
class _Item:
    name: str
    rows: tuple[tuple[int, ...], ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def test_tickets_that_fit_vllms_cache_alone_but_not_together_wait_for_the_next_batch() -> None:
    """Black-box: 12 concurrent CFG requests of 2 x 301 tokens (6 blocks) on an 11-block vLLM cache:
    7 failed INTERNAL PREFILL_FAILED "VllmCacheFull: the rows need 6 KV blocks ...; vLLM has 5 free
    of 11 (the others hold tickets not yet written)": a batch's tickets each fit, but the batch held
    more than the cache. The AR's batcher now takes tickets up to vLLM's whole cache per batch."""
    state = _state(11)
    servicer = ArServicer(None, ArMetrics.create(CollectorRegistry()), lambda reason: None)
    servicer.attach(state)
    batches: list[list[str]] = []

    async def run(items: list[_Item]) -> list[str]:
        batches.append([i.name for i in items])
        return [i.name for i in items]

    async def scenario(batcher: PrefillBatcher, ranks: asyncio.Lock) -> None:
        six = ((1,) * 301, (2,) * 301)  # 3 + 3 blocks of 128
        items = [_Item("a", six), _Item("b", six), _Item("c", ((3,) * 128,) * 5), _Item("d", ((4,) * 10,))]

        async def one(item: _Item) -> None:
            async with batcher.turn(item):
                pass

        async with ranks:  # the ranks are busy while all four arrive
            tasks = [asyncio.ensure_future(one(i)) for i in items]
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)

    ranks = asyncio.Lock()
    sized = servicer.prefills
    batcher = PrefillBatcher(
        run, ranks, max_batch=8, max_tokens=1 << 20, blocks=sized._blocks, max_blocks=sized.max_blocks
    )
    asyncio.run(scenario(batcher, ranks))
    # 6 + 6 > 11: b waits; then 6 + 5 = 11 fits exactly; d (1 block) goes with nothing past 11.
    assert batches == [["a"], ["b", "c"], ["d"]]
    # Without a block budget (the built-in engine) they share one batch, as before.
    batches.clear()
    ranks = asyncio.Lock()
    asyncio.run(scenario(PrefillBatcher(run, ranks, max_batch=8, max_tokens=1 << 20), ranks))
    assert batches == [["a", "b", "c", "d"]]
