"""Property tests of the pure layout and planner: executing a plan with plain memory copies must
reproduce, on every consumer rank, exactly the heads it needs of every row, and touch no byte
outside the reserved pages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.transfer.layout import ITEMSIZE, KvGeometry, PageLayout
from kvrelay.transfer.planner import (
    PlannedWrite,
    RowSpec,
    head_overlap,
    max_segments_per_peer,
    plan_transfer,
    staging_bytes,
)

UINT_OF = {2: np.uint16, 4: np.uint32}
SENTINEL = 0xA5


@st.composite
def transfer_cases(draw: st.DrawFn) -> tuple[KvGeometry, int, int, list[RowSpec], int]:
    num_kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    shard_choices = [n for n in (1, 2, 4) if num_kv_heads % n == 0]
    src_shards = draw(st.sampled_from(shard_choices))
    dst_shards = draw(st.sampled_from(shard_choices))
    geometry = KvGeometry(
        num_layers=draw(st.integers(1, 3)),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([1, 2, 4, 8])),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        page_size=draw(st.integers(1, 8)),
    )
    num_rows = draw(st.integers(1, 2))
    tokens = [draw(st.integers(1, 4 * geometry.page_size + 3)) for _ in range(num_rows)]
    need = sum(geometry.pages_for(t) for t in tokens)
    pool_pages = need + draw(st.integers(0, 4))
    # A permutation of the pool: pages of a row may be contiguous runs or scattered.
    order = draw(st.permutations(list(range(pool_pages))))
    if draw(st.booleans()):
        order = sorted(order[:need]) + list(order[need:])
    rows, at = [], 0
    for i, t in enumerate(tokens):
        n = geometry.pages_for(t)
        rows.append(RowSpec(row=i, num_tokens=t, page_ids=tuple(order[at : at + n])))
        at += n
    return geometry, src_shards, dst_shards, rows, pool_pages


def _row_values(geometry: KvGeometry, spec: RowSpec) -> np.ndarray:
    """Distinct nonzero element values [L, 2, H, T_padded, hd] for a row; padding tokens are 0."""
    g = geometry
    padded = g.pages_for(spec.num_tokens) * g.page_size
    shape = (g.num_layers, 2, g.num_kv_heads, padded, g.head_dim)
    rng = np.random.default_rng(1000 + spec.row)
    bits = 8 * g.itemsize
    vals = rng.integers(1, 2**bits, size=shape, dtype=np.uint64).astype(UINT_OF[g.itemsize])
    vals[:, :, :, spec.num_tokens :, :] = 0
    return vals


def _reference_staging(
    geometry: KvGeometry, src_shards: int, dst_shards: int, plan: tuple[PlannedWrite, ...],
    rows: list[RowSpec], src_rank: int,
) -> bytes:
    """Staging contract: each write, in plan order, as [page][layer][k|v][overlap head][token][dim]."""
    g = geometry
    by_row = {r.row: r for r in rows}
    out = bytearray()
    for w in plan:
        if w.src_rank != src_rank:
            continue
        spec = by_row[w.row]
        overlap = head_overlap(g, src_shards, dst_shards, w.src_rank, w.dst_rank)
        assert overlap is not None
        lo, hi = overlap
        vals = _row_values(g, spec)[:, :, lo:hi]
        npages = len(spec.page_ids)
        blk = vals.reshape(g.num_layers, 2, hi - lo, npages, g.page_size, g.head_dim)
        out += np.ascontiguousarray(blk.transpose(3, 0, 1, 2, 4, 5)).tobytes()
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(transfer_cases())
def test_executing_plan_reproduces_needed_heads_and_touches_nothing_else(case) -> None:
    geometry, src_shards, dst_shards, rows, pool_pages = case
    g = geometry
    plan = plan_transfer(geometry, src_shards, dst_shards, rows)
    staging = {
        s: _reference_staging(g, src_shards, dst_shards, plan, rows, s) for s in range(src_shards)
    }
    for s in range(src_shards):
        assert staging_bytes(plan, s) == len(staging[s])
    pools = {}
    written = {}
    for d in range(dst_shards):
        layout = PageLayout(g, dst_shards, d)
        pools[d] = np.full(layout.pool_bytes(pool_pages), SENTINEL, dtype=np.uint8)
        written[d] = np.zeros(layout.pool_bytes(pool_pages), dtype=np.int32)
    for w in plan:
        src_cursor = w.staging_start
        for seg in w.segments:
            # A write's segments are contiguous in staging, in order.
            assert seg.src_offset == src_cursor
            src_cursor += seg.length
            assert seg.length > 0
            buf = np.frombuffer(staging[w.src_rank], dtype=np.uint8)
            pools[w.dst_rank][seg.dst_offset : seg.dst_offset + seg.length] = buf[
                seg.src_offset : seg.src_offset + seg.length
            ]
            written[w.dst_rank][seg.dst_offset : seg.dst_offset + seg.length] += 1
    reserved = sorted(p for r in rows for p in r.page_ids)
    for d in range(dst_shards):
        layout = PageLayout(g, dst_shards, d)
        hps = layout.heads_per_shard
        counts = written[d].reshape(pool_pages, layout.page_bytes)
        # Every byte of every reserved page written exactly once; nothing else touched.
        assert (counts[reserved] == 1).all()
        untouched = [p for p in range(pool_pages) if p not in set(reserved)]
        pool_pages_u8 = pools[d].reshape(pool_pages, layout.page_bytes)
        assert (counts[untouched] == 0).all()
        assert (pool_pages_u8[untouched] == SENTINEL).all()
        typed = pools[d].view(UINT_OF[g.itemsize]).reshape(
            pool_pages, g.num_layers, 2, hps, g.page_size, g.head_dim
        )
        for spec in rows:
            vals = _row_values(g, spec)[:, :, layout.head_start : layout.head_start + hps]
            for i, page in enumerate(spec.page_ids):
                expect = vals[:, :, :, i * g.page_size : (i + 1) * g.page_size, :]
                assert np.array_equal(typed[page], expect), (spec.row, page, d)


@settings(max_examples=60, deadline=None)
@given(transfer_cases())
def test_plan_is_deterministic_and_sized(case) -> None:
    geometry, src_shards, dst_shards, rows, _ = case
    plan = plan_transfer(geometry, src_shards, dst_shards, rows)
    assert plan == plan_transfer(geometry, src_shards, dst_shards, list(rows))
    total_pages = sum(len(r.page_ids) for r in rows)
    for s in range(src_shards):
        # Each head a source rank holds goes to exactly one destination head shard.
        per_page = geometry.num_layers * 2 * (geometry.num_kv_heads // src_shards)
        per_page *= geometry.page_size * geometry.head_dim * geometry.itemsize
        assert staging_bytes(plan, s) == total_pages * per_page
    # Every (row, dst) gets its heads from exactly the overlapping sources.
    expected_pairs = max(src_shards, dst_shards) * len(rows)
    assert len(plan) == expected_pairs


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 4), st.sampled_from([1, 2, 4, 8]), st.integers(1, 8), st.sampled_from(list(ITEMSIZE)),
    st.integers(1, 6), st.data(),
)
def test_page_layout_offset_is_hnd_row_major(layers, heads, head_dim, dtype, page_size, data) -> None:
    g = KvGeometry(layers, heads, head_dim, dtype, page_size)
    num_shards = data.draw(st.sampled_from([n for n in (1, 2, 4, 8) if heads % n == 0]))
    shard = data.draw(st.integers(0, num_shards - 1))
    layout = PageLayout(g, num_shards, shard)
    shape = (5, layers, 2, layout.heads_per_shard, page_size, head_dim)
    idx = tuple(data.draw(st.integers(0, n - 1)) for n in shape[:-1])
    flat = int(np.ravel_multi_index(idx + (0,), shape))
    assert layout.offset(*idx) == flat * g.itemsize
    assert layout.page_bytes * 5 == int(np.prod(shape)) * g.itemsize


def test_full_head_writes_coalesce_into_one_segment_per_page_run() -> None:
    g = KvGeometry(num_layers=4, num_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=16)
    rows = [RowSpec(0, 70, (3, 4, 5, 9, 10)), RowSpec(1, 16, (0,))]
    plan = plan_transfer(g, 1, 1, rows)
    assert [len(w.segments) for w in plan] == [2, 1]
    layout = PageLayout(g, 1, 0)
    assert plan[0].segments[0].dst_offset == 3 * layout.page_bytes
    assert plan[0].segments[0].length == 3 * layout.page_bytes
    # TP=2 -> TP=2: each destination still gets all its heads from one source: whole pages.
    plan2 = plan_transfer(g, 2, 2, rows)
    assert [(w.row, w.src_rank, w.dst_rank, len(w.segments)) for w in plan2] == [
        (0, 0, 0, 2), (0, 1, 1, 2), (1, 0, 0, 1), (1, 1, 1, 1),
    ]
    # TP=2 -> TP=1: half the heads per (page, layer, k|v); no coalescing across them.
    plan3 = plan_transfer(g, 2, 1, rows)
    assert len(plan3[0].segments) == 5 * 4 * 2
    assert max_segments_per_peer(plan3, 0) == 6 * 4 * 2


def test_rejects_bad_inputs_with_named_cause() -> None:
    g = KvGeometry(num_layers=1, num_kv_heads=4, head_dim=2, dtype="float16", page_size=4)
    with pytest.raises(ValueError, match="need 2 pages"):
        plan_transfer(g, 1, 1, [RowSpec(0, 5, (0,))])
    with pytest.raises(ValueError, match="reserved for both"):
        plan_transfer(g, 1, 1, [RowSpec(0, 4, (1,)), RowSpec(1, 4, (1,))])
    with pytest.raises(ValueError, match="do not divide"):
        plan_transfer(g, 3, 1, [RowSpec(0, 4, (0,))])
    with pytest.raises(ValueError, match="appears twice"):
        plan_transfer(g, 1, 1, [RowSpec(0, 4, (0,)), RowSpec(0, 4, (1,))])
    with pytest.raises(ValueError, match="dtype"):
        KvGeometry(1, 1, 1, "int8", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head_local"):
        PageLayout(g, 2, 1).offset(0, 0, 0, 2)


@pytest.mark.parametrize(("ar_tp", "dst_shards"), [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_cfg_parallel_places_each_row_only_on_its_group_and_halves_bytes_per_rank(ar_tp: int, dst_shards: int) -> None:
    g = KvGeometry(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", page_size=16)
    rows = [RowSpec(0, 40, (3, 4, 7)), RowSpec(1, 40, (0, 1, 2))]
    plain = plan_transfer(g, ar_tp, dst_shards, rows)
    split = plan_transfer(g, ar_tp, dst_shards, rows, cfg_parallel=2)

    def per_rank(plan: tuple[PlannedWrite, ...]) -> dict[int, int]:
        out: dict[int, int] = {}
        for w in plan:
            out[w.dst_rank] = out.get(w.dst_rank, 0) + w.num_bytes
        return out

    # Row r lands only on group r's ranks (r * dst_shards + shard), nowhere else.
    for w in split:
        assert w.dst_rank // dst_shards == w.row
    # Same writes (segments, sources, staging) as the plain plan, only the destinations move.
    assert [(w.row, w.src_rank, w.dst_rank % dst_shards, w.segments) for w in split] == [
        (w.row, w.src_rank, w.dst_rank, w.segments) for w in plain
    ]
    # Twice the DiT ranks, each receiving half the bytes a rank of the plain layout receives.
    plain_bytes, split_bytes = per_rank(plain), per_rank(split)
    assert sorted(split_bytes) == list(range(2 * dst_shards))
    assert all(split_bytes[r] * 2 == plain_bytes[r % dst_shards] for r in split_bytes)
    assert sum(split_bytes.values()) == sum(plain_bytes.values())
    with pytest.raises(ValueError, match="cfg_parallel"):
        plan_transfer(g, ar_tp, dst_shards, rows, cfg_parallel=0)
