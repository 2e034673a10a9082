"""vLLM as the AR engine, at the rank-handler level: one real vLLM engine (CPU) in a kvrelay worker
process, running a tiny random Llama built at test time, with KvRelayConnector loaded by vLLM from
the KVTransferConfig kvrelay builds. One engine start for the whole module.

Checked: vLLM's KV (read out of its paged blocks) equals the built-in torch AR's on the same
checkpoint within fp32 tolerance; a ticket written over real Mooncake lands in DiT-layout pages
equal to vLLM's cache bit for bit (TP=1 -> two destination head shards); dropped tickets and
aborted requests give every block back to vLLM; the tokenizer the AR service uses is vLLM's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="engine: vllm needs vLLM (scripts/setup.sh --vllm)")

from kvrelay.ar_service.engine import (  # noqa: E402
    CollectFinished,
    DescribeRank,
    DropTicket,
    HeldTickets,
    PrefillDone,
    PrefillFailed,
    PrefillTicket,
    PrefillTickets,
    WriteTicket,
)
from kvrelay.ar_service.vllm_engine import (  # noqa: E402
    PREFILL_FAULT_ENV,
    EngineStats,
    OnWorkers,
    ReadHeld,
    VllmRankSpec,
    VllmTokenizer,
    engine_env,
)
from kvrelay.ar_service.vllm_tokenizer import BackendTokenizer, DescribeTokenizer, torch_free_problem  # noqa: E402
from kvrelay.models.ar import build_ar_model  # noqa: E402
from kvrelay.transfer.layout import KvGeometry, PageLayout  # noqa: E402
from kvrelay.transfer.pack import read_row  # noqa: E402
from kvrelay.transfer.planner import RowSpec, plan_transfer  # noqa: E402
from kvrelay.transfer.transport import make_receiver  # noqa: E402
from kvrelay.worker import WorkerCommandError, WorkerGroup  # noqa: E402
from tests.vllm.checkpoint import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, build_checkpoint  # noqa: E402
from tests.vllm.gates import finished_not_returned, hold_transfers, release_transfers  # noqa: E402

pytestmark = pytest.mark.slow

PAGE_SIZE = 16
PROMPT = "a small red boat on a calm lake at dawn, oil painting, soft light" * 3
CACHE_BLOCKS = 11  # vLLM's block 0 is its null block
# A row containing this text makes the engine's prefill raise mid-pass (the fault hook).
FAULT_MARKER = "@@fault@@"
# Pools registered with the test process's one Mooncake engine stay registered for its lifetime.
_REGISTERED: list[torch.Tensor] = []


def _spec(path: Path, transport: str) -> VllmRankSpec:
    return VllmRankSpec(
        path=str(path),
        tokenizer=None,
        dtype="float32",
        tensor_parallel_size=1,
        max_num_seqs=2,
        transfer={
            "kv_connector": "KvRelayConnector",
            "kv_connector_module_path": "kvrelay.ar_service.vllm_connector",
            "kv_role": "kv_producer",
            "engine_id": "ar",
            "kv_connector_extra_config": {
                "transport": transport,
                "hostname": "127.0.0.1",
                "mooncake_protocol": "tcp",
                "staging_bytes": 8 << 20,
            },
        },
        # Small batches: a long prompt takes several steps (chunked prefill), as on a busy engine.
        # A small cache (11 usable blocks of 128 tokens): every ticket here fits, the cache tests fill it.
        vllm_args={"max_model_len": 1024, "max_num_batched_tokens": 128, "enable_chunked_prefill": True,
                   "num_gpu_blocks_override": CACHE_BLOCKS + 1},
        # Far below the default 300 s: a prefill that waits on vLLM's blocks fails the test, not hangs it.
        prefill_timeout_s=60.0,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[WorkerGroup]:
    marker = VllmTokenizer(str(checkpoint)).encode(FAULT_MARKER)[1:]  # without BOS
    env = {**engine_env(), PREFILL_FAULT_ENV: ",".join(map(str, marker))}
    with WorkerGroup(1, _spec(checkpoint, "mooncake"), env=env, name="kvrelay-vllm-test") as group:
        yield group
        assert group.call_all(HeldTickets()) == [[]]


def _stats(group: WorkerGroup) -> Any:
    return group.call_all(EngineStats())[0]


def _assert_all_blocks_free(group: WorkerGroup) -> None:
    stats = _stats(group)
    assert stats.held_request_ids == () and stats.held_tickets == ()
    assert stats.free_blocks == stats.total_blocks, stats


def test_description_is_the_checkpoints_geometry(engine: WorkerGroup) -> None:
    (desc,) = engine.call_all(DescribeRank())
    assert (desc.num_layers, desc.num_kv_heads, desc.head_dim, desc.dtype) == (
        NUM_LAYERS,
        NUM_KV_HEADS,
        HEAD_DIM,
        "float32",
    )
    # A prompt of max_model_len tokens leaves no room for the one sampled token: vLLM refuses it.
    assert desc.max_tokens == 1023 and desc.transport == "mooncake" and ":" in desc.session
    # Several tickets share a scheduling step: the service sends PrefillTickets, up to the step's budget.
    assert desc.prefill_batch_tokens == 128
    # vLLM's whole cache: the service refuses rows that need more (NEVER_FITS) before the engine.
    assert (desc.cache_blocks, desc.cache_block_size) == (CACHE_BLOCKS, 128)
    _assert_all_blocks_free(engine)


def test_tokenizer_is_vllms(checkpoint: Path) -> None:
    from vllm.tokenizers import get_tokenizer

    ours = VllmTokenizer(str(checkpoint))
    theirs = get_tokenizer(str(checkpoint))
    for text in (PROMPT, "", "héllo wörld ✓"):
        assert ours.encode(text) == list(theirs.encode(text))
    assert ours.encode("")[0] == ours.bos_id


def test_the_engine_describes_its_tokenizer_for_the_service(engine: WorkerGroup, checkpoint: Path) -> None:
    """DescribeTokenizer: the service builds vLLM's own tokenizer pipeline from the engine's
    description, without torch, and it gives the ids of transformers' path (VllmTokenizer)."""
    (described,) = engine.call_all(DescribeTokenizer())
    assert torch_free_problem(described) is None, described.reason
    ours, theirs = BackendTokenizer(described), VllmTokenizer(str(checkpoint))
    for text in (PROMPT, "", "héllo wörld ✓", "<s>x</s>"):
        assert ours.encode(text) == theirs.encode(text)
    assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (theirs.vocab_size, theirs.bos_id, theirs.eos_id)


def test_kv_matches_builtin_ar_and_drop_returns_blocks(engine: WorkerGroup, checkpoint: Path) -> None:
    tok = VllmTokenizer(str(checkpoint))
    rows = (tuple(tok.encode(PROMPT)), tuple(tok.encode("")))
    assert len(rows[0]) > 128  # spans several blocks and several chunked-prefill steps
    (done,) = engine.call_all(PrefillTicket("parity", rows))
    assert done.token_counts == (len(rows[0]), len(rows[1]))
    stats = _stats(engine)
    assert stats.held_tickets == ("parity",) and len(stats.held_request_ids) == 2
    assert stats.free_blocks == stats.total_blocks - 2 - 1  # 2 blocks for row 0, 1 for row 1
    (per_row,) = engine.call_all(ReadHeld("parity"))
    builtin = build_ar_model(path=checkpoint, dtype="float32")
    for ids, (kv,) in zip(rows, per_row, strict=True):
        ref = builtin.prefill(list(ids))
        assert kv.shape == ref.shape == (NUM_LAYERS, 2, NUM_KV_HEADS, len(ids), HEAD_DIM)
        torch.testing.assert_close(kv, ref, rtol=1e-4, atol=1e-4)
    engine.call_all(DropTicket("parity"))
    _assert_all_blocks_free(engine)


def _destination(ticket_rows: tuple[tuple[int, ...], ...], dst_shards: int = 2) -> Any:
    """DiT-layout pools on `dst_shards` head shards registered with a real Mooncake endpoint, the
    rows on scattered, non-contiguous pages, and the plan."""
    geometry = KvGeometry(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, "float32", PAGE_SIZE)
    layouts = [PageLayout(geometry, dst_shards, r) for r in range(dst_shards)]
    pools = [torch.full((lay.pool_bytes(32),), 0xA5, dtype=torch.uint8) for lay in layouts]
    _REGISTERED.extend(pools)
    receiver = make_receiver("mooncake", hostname="127.0.0.1")
    destinations = tuple(receiver.register_region(pool, rank) for rank, pool in enumerate(pools))
    specs, next_page = [], 1
    for row, ids in enumerate(ticket_rows):
        n = -(-len(ids) // PAGE_SIZE)
        specs.append(RowSpec(row, len(ids), tuple(range(next_page, next_page + 2 * n, 2))))
        next_page += 2 * n + 1
    plan = plan_transfer(geometry, 1, dst_shards, specs)
    return geometry, layouts, pools, destinations, tuple(specs), plan


def _assert_pages_equal_cache(cache_rows: Any, layouts: Any, pools: Any, specs: Any) -> None:
    dst_shards = len(layouts)
    for row, (kv,) in enumerate(cache_rows):
        for rank, layout in enumerate(layouts):
            landed = read_row(pools[rank], layout, specs[row])
            lo = rank * NUM_KV_HEADS // dst_shards
            hi = lo + NUM_KV_HEADS // dst_shards
            # Bit for bit: the same bytes, not just close values.
            assert torch.equal(landed.view(torch.int32), kv[:, :, lo:hi].contiguous().view(torch.int32))


def test_written_pages_equal_vllm_cache_bit_for_bit(engine: WorkerGroup, checkpoint: Path) -> None:
    tok = VllmTokenizer(str(checkpoint))
    rows_ids = (tuple(tok.encode(PROMPT[:150])), tuple(tok.encode("blurry")))
    geometry, layouts, pools, destinations, specs, plan = _destination(rows_ids)
    engine.call_all(PrefillTicket("bits", rows_ids))
    (cache_rows,) = engine.call_all(ReadHeld("bits"))
    (done,) = engine.call_all(WriteTicket("bits", specs, geometry, 1, 2, plan, destinations, timeout_s=30.0))
    assert sorted((o.row, o.dst_rank, o.status) for o in done.outcomes) == [
        (r, d, "OK") for r in range(2) for d in range(2)
    ]
    assert all(o.checksum != 0 and o.bytes > 0 for o in done.outcomes)
    _assert_pages_equal_cache(cache_rows, layouts, pools, specs)
    # Every write had a final outcome: the blocks are back with vLLM.
    _assert_all_blocks_free(engine)


def test_in_doubt_write_gives_vllms_blocks_back_at_once_and_keeps_its_staging(
    engine: WorkerGroup, checkpoint: Path
) -> None:
    """The write copies the rows out of vLLM's blocks before its transport call, which reads only
    the ticket's staging region: the blocks go back to vLLM at once, even while the call is in
    doubt (they stayed pinned until it returned, for good when the sender raised), and a prefill
    that reuses them meanwhile does not change the bytes that land. The staging region stays
    held until the call returns."""
    tok = VllmTokenizer(str(checkpoint))
    rows_ids = (tuple(tok.encode(PROMPT[:100])), tuple(tok.encode("dull")))
    geometry, layouts, pools, destinations, specs, plan = _destination(rows_ids)
    engine.call_all(PrefillTicket("doubt", rows_ids))
    (cache_rows,) = engine.call_all(ReadHeld("doubt"))
    engine.call_all(OnWorkers(hold_transfers))
    try:
        (done,) = engine.call_all(
            WriteTicket("doubt", specs, geometry, 1, 2, plan, destinations, timeout_s=0.3)
        )
        assert {o.status for o in done.outcomes} == {"IN_DOUBT"}
        # The transport call still runs, from staging: vLLM has every block back.
        _assert_all_blocks_free(engine)
        (collected,) = engine.call_all(CollectFinished())
        assert collected.finished == () and collected.in_doubt_tickets == ("doubt",)
        assert collected.staging_bytes_held > 0
        # Another ticket fills the whole cache (the blocks the in-doubt rows were read from too).
        engine.call_all(PrefillTicket("reuse", ((9,) * 6 * 128, (8,) * 5 * 128)))  # 6 + 5 blocks
        assert _stats(engine).free_blocks == 0
        engine.call_all(DropTicket("reuse"))
    finally:
        engine.call_all(OnWorkers(release_transfers))
    deadline = time.monotonic() + 30
    finished: list[Any] = []
    while not finished and time.monotonic() < deadline:
        (collected,) = engine.call_all(CollectFinished())
        finished.extend(collected.finished)
        time.sleep(0.05)
    assert [t for t, _ in finished] == ["doubt"]
    assert sorted((o.row, o.dst_rank, o.status) for o in finished[0][1]) == [
        (r, d, "OK") for r in range(2) for d in range(2)
    ]
    (collected,) = engine.call_all(CollectFinished())
    assert collected.in_doubt_tickets == () and collected.staging_bytes_held == 0
    _assert_all_blocks_free(engine)
    # What landed is the doubt ticket's KV, not the reuse ticket's.
    _assert_pages_equal_cache(cache_rows, layouts, pools, specs)


def test_aborted_request_returns_its_blocks(engine: WorkerGroup, checkpoint: Path) -> None:
    tok = VllmTokenizer(str(checkpoint))
    good = tuple(tok.encode(PROMPT))
    bad = (tok.bos_id or 0, 10_000_000)  # outside the vocabulary: vLLM refuses the row
    with pytest.raises(WorkerCommandError):
        engine.call_all(PrefillTicket("aborted", (good, bad)))
    # The good row was already queued in vLLM: it was aborted and its blocks freed, none held.
    _assert_all_blocks_free(engine)
    # The engine serves the next ticket normally.
    engine.call_all(PrefillTicket("after", (good,)))
    engine.call_all(DropTicket("after"))
    _assert_all_blocks_free(engine)
    # Those steps told the worker side the aborted row finished: it keeps no trace of it (such ids
    # were kept as "finished" for good, one per aborted row, for the engine's life).
    assert engine.call_all(OnWorkers(finished_not_returned)) == [[[]]]  # rank 0, its one vLLM worker


def _alone(group: WorkerGroup, ticket_id: str, rows: tuple[tuple[int, ...], ...]) -> Any:
    group.call_all(PrefillTicket(ticket_id, rows))
    (cache_rows,) = group.call_all(ReadHeld(ticket_id))
    group.call_all(DropTicket(ticket_id))
    return cache_rows


def test_tickets_prefilled_together_hold_what_each_would_alone(engine: WorkerGroup, checkpoint: Path) -> None:
    tok = VllmTokenizer(str(checkpoint))
    tickets = {
        "t-a": (tuple(tok.encode(PROMPT[:150])), tuple(tok.encode("blurry"))),
        "t-b": (tuple(tok.encode(PROMPT)),),  # several chunked-prefill steps
        "t-c": (tuple(tok.encode("a cat on a mat")), tuple(tok.encode(""))),
    }
    alone = {t: _alone(engine, t, rows) for t, rows in tickets.items()}
    _assert_all_blocks_free(engine)
    (answers,) = engine.call_all(PrefillTickets(tuple(PrefillTicket(t, rows) for t, rows in tickets.items())))
    assert [type(a) for a in answers] == [PrefillDone] * 3
    assert [a.token_counts for a in answers] == [tuple(len(ids) for ids in rows) for rows in tickets.values()]
    assert len({a.seconds for a in answers}) == 1  # one shared pass
    assert _stats(engine).held_tickets == tuple(sorted(tickets))
    for ticket_id, rows in tickets.items():
        (together,) = engine.call_all(ReadHeld(ticket_id))
        assert len(together) == len(rows)
        for (kv,), (ref,) in zip(together, alone[ticket_id], strict=True):
            # Bit for bit: batching changes which rows share a step, not what a row computes.
            torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    # One ticket of the batch written, the others dropped: every block is back with vLLM.
    rows_a = tickets["t-a"]
    geometry, layouts, pools, destinations, specs, plan = _destination(rows_a)
    (done,) = engine.call_all(WriteTicket("t-a", specs, geometry, 1, 2, plan, destinations, timeout_s=30.0))
    assert {o.status for o in done.outcomes} == {"OK"}
    _assert_pages_equal_cache(alone["t-a"], layouts, pools, specs)
    engine.call_all(DropTicket("t-b"))
    engine.call_all(DropTicket("t-c"))
    _assert_all_blocks_free(engine)


def test_a_bad_ticket_in_a_batch_fails_alone(engine: WorkerGroup, checkpoint: Path) -> None:
    tok = VllmTokenizer(str(checkpoint))
    good = (tuple(tok.encode(PROMPT[:120])), tuple(tok.encode("")))
    items = (
        PrefillTicket("ok-1", good),
        PrefillTicket("vocab", (good[0], (tok.bos_id or 0, 10_000_000))),  # outside the vocabulary
        PrefillTicket("ok-1", good),  # the same ticket twice in one command
        PrefillTicket("long", ((1,) * 1024,)),  # max_model_len: no room for the sampled token
        PrefillTicket("empty", ((),)),
        PrefillTicket("ok-2", (good[1],)),
    )
    (answers,) = engine.call_all(PrefillTickets(items))
    assert [type(a) for a in answers] == [PrefillDone, PrefillFailed, PrefillFailed, PrefillFailed, PrefillFailed, PrefillDone]
    assert "token ids must be in" in answers[1].message and "twice" in answers[2].message
    assert "1024 tokens" in answers[3].message and "no tokens" in answers[4].message
    assert _stats(engine).held_tickets == ("ok-1", "ok-2")
    for ticket_id, rows in (("ok-1", good), ("ok-2", (good[1],))):
        (cache_rows,) = engine.call_all(ReadHeld(ticket_id))
        assert [kv.shape[3] for (kv,) in cache_rows] == [len(ids) for ids in rows]
        engine.call_all(DropTicket(ticket_id))
    _assert_all_blocks_free(engine)


def test_a_fault_mid_shared_prefill_is_retried_ticket_by_ticket(
    engine: WorkerGroup, checkpoint: Path
) -> None:
    tok = VllmTokenizer(str(checkpoint))
    tickets = {
        "mate-1": (tuple(tok.encode(PROMPT)), tuple(tok.encode(""))),  # several chunked-prefill steps
        "faulty": (tuple(tok.encode("short")), tuple(tok.encode(f"a cat {FAULT_MARKER} on a mat"))),
        "mate-2": (tuple(tok.encode("blurry")),),
    }
    alone = {t: _alone(engine, t, rows) for t, rows in tickets.items() if t != "faulty"}
    (answers,) = engine.call_all(PrefillTickets(tuple(PrefillTicket(t, rows) for t, rows in tickets.items())))
    # The shared pass raised after its first finished rows (some already held); each ticket was
    # then prefilled alone: the batch-mates hold their KV, the faulty one fails with the reason.
    assert [type(a) for a in answers] == [PrefillDone, PrefillFailed, PrefillDone]
    assert "InjectedPrefillFault" in answers[1].message and "ticket faulty" in answers[1].message
    assert answers[0].seconds != answers[2].seconds  # two passes, not the shared one
    assert _stats(engine).held_tickets == ("mate-1", "mate-2")
    for ticket_id, ref in alone.items():
        (cache_rows,) = engine.call_all(ReadHeld(ticket_id))
        for (kv,), (want,) in zip(cache_rows, ref, strict=True):
            torch.testing.assert_close(kv, want, rtol=0, atol=0)
        engine.call_all(DropTicket(ticket_id))
    # Nothing of the aborted pass or the failed retry is left in vLLM.
    _assert_all_blocks_free(engine)
    # The engine keeps serving, batched.
    (answers,) = engine.call_all(
        PrefillTickets(
            (PrefillTicket("next-1", tickets["mate-2"]), PrefillTicket("next-2", tickets["mate-1"]))
        )
    )
    assert [type(a) for a in answers] == [PrefillDone, PrefillDone] and answers[0].seconds == answers[
        1
    ].seconds
    engine.call_all(DropTicket("next-1"))
    engine.call_all(DropTicket("next-2"))
    _assert_all_blocks_free(engine)


def test_rows_that_do_not_fit_vllms_cache_fail_at_once(engine: WorkerGroup) -> None:
    assert _stats(engine).total_blocks == CACHE_BLOCKS and _stats(engine).block_size == 128
    started = time.monotonic()
    # 2 x 6 blocks: more than the whole cache; alone or in a batch, it fails before reaching vLLM.
    with pytest.raises(WorkerCommandError, match=r"VllmCacheFull: its rows need 12 KV blocks .* whole cache has 11 \(raise"):
        engine.call_all(PrefillTicket("huge", ((5,) * 700, (6,) * 700)))
    (answers,) = engine.call_all(PrefillTickets((PrefillTicket("huge", ((5,) * 700, (6,) * 700)),)))
    assert "need 12 KV blocks of 128 tokens at once; vLLM's whole cache has 11" in answers[0].message
    _assert_all_blocks_free(engine)
    # 5 + 5 + 3 blocks do not fit 11 together: each goes alone; the first two are held, the last
    # one finds 1 block free and fails, naming the numbers.
    items = (
        PrefillTicket("x", ((5,) * 600,)),
        PrefillTicket("y", ((6,) * 600,)),
        PrefillTicket("z", ((7,) * 300,)),
    )
    (answers,) = engine.call_all(PrefillTickets(items))
    assert [type(a) for a in answers] == [PrefillDone, PrefillDone, PrefillFailed]
    assert "need 3 KV blocks of 128 tokens; vLLM has 1 free of 11" in answers[2].message
    # No prefill waited for blocks (the timeout is 60 s, each pass here well under a second's work).
    assert time.monotonic() - started < 30
    assert _stats(engine).held_tickets == ("x", "y")
    engine.call_all(DropTicket("x"))
    engine.call_all(DropTicket("y"))
    _assert_all_blocks_free(engine)
    # With the cache free again, z prefills.
    (answers,) = engine.call_all(PrefillTickets((items[2],)))
    assert [type(a) for a in answers] == [PrefillDone]
    engine.call_all(DropTicket("z"))
    _assert_all_blocks_free(engine)
