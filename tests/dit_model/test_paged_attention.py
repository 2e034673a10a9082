"""Prefix K/V through pages: bytes placed by PageLayout offsets read back as the same bits, and
attention over them equals attention over the dense prefix bit for bit (the seed's
`attention_bits_equal True`, `max_abs_diff 0.0`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvrelay.models.dit import DitModel, DitParallel, init_seeded_weights, random_prefix
from kvrelay.models.paged_attention import pool_pages, prefix_attention, read_prefix, write_prefix
from kvrelay.models.presets import get_preset
from kvrelay.transfer.layout import K_INDEX, V_INDEX, KvGeometry, PageLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_by_offsets(pool: torch.Tensor, layout: PageLayout, page_ids: list[int], prefix) -> None:
    """Independent writer: every (page, layer, k|v, head) run of tokens placed at the byte offset
    PageLayout.offset names, as raw bytes (what a transport does), without pool_pages' view."""
    g = layout.geometry
    raw = pool.numpy()
    for layer, (k, v) in enumerate(prefix):
        for kv, src in ((K_INDEX, k), (V_INDEX, v)):
            for head in range(layout.heads_per_shard):
                for i, page in enumerate(page_ids):
                    lo, hi = i * g.page_size, min((i + 1) * g.page_size, src.shape[1])
                    data = src[head, lo:hi].contiguous().view(torch.uint8).reshape(-1).numpy()
                    start = layout.offset(page, layer, kv, head, 0)
                    raw[start : start + data.size] = data


def _layout(dtype: str, page_size: int, num_shards: int = 2, shard: int = 1) -> PageLayout:
    geometry = KvGeometry(num_layers=3, num_kv_heads=4, head_dim=16, dtype=dtype, page_size=page_size)  # type: ignore[arg-type]
    return PageLayout(geometry, num_shards=num_shards, shard=shard)


def _dense_prefix(layout: PageLayout, num_tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = layout.geometry
    gen = torch.Generator().manual_seed(seed)
    shape = (g.num_layers, 2, layout.heads_per_shard, num_tokens, g.head_dim)
    kv = torch.randn(shape, generator=gen).to(DTYPES[g.dtype])
    return [(kv[layer, 0], kv[layer, 1]) for layer in range(g.num_layers)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("num_tokens", "page_ids"),
    [
        (5, [3]),  # shorter than a page: zero-copy views
        (16, [0]),  # exactly one page
        (37, [2, 3, 4]),  # a contiguous run
        (37, [6, 1, 4]),  # scattered pages, out of order
    ],
)
def test_paged_prefix_attention_bits_equal_dense(dtype: str, num_tokens: int, page_ids: list[int]) -> None:
    layout = _layout(dtype, page_size=16)
    dense = _dense_prefix(layout, num_tokens, seed=num_tokens)
    # Garbage, not zeros, in the pool: a read that strays outside the row's tokens must show.
    pool = torch.randint(
        0, 256, (layout.pool_bytes(8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)
    )
    write_by_offsets(pool, layout, page_ids, dense)

    paged = read_prefix(pool, layout, page_ids, num_tokens)

    prefix_bits_equal = all(
        torch.equal(pk, dk) and torch.equal(pv, dv) for (pk, pv), (dk, dv) in zip(paged, dense, strict=True)
    )
    assert prefix_bits_equal
    gen = torch.Generator().manual_seed(1)
    heads_kv, heads_q, n, d = layout.heads_per_shard, 2 * layout.heads_per_shard, 24, 16
    q = torch.randn(2, heads_q, n, d, generator=gen).to(DTYPES[dtype])
    k = torch.randn(2, heads_kv, n, d, generator=gen).to(DTYPES[dtype])
    v = torch.randn(2, heads_kv, n, d, generator=gen).to(DTYPES[dtype])
    for layer in range(layout.geometry.num_layers):
        out_paged = prefix_attention(q, k, v, [paged[layer], paged[layer]])
        out_dense = prefix_attention(q, k, v, [dense[layer], dense[layer]])
        max_abs_diff = (out_paged.float() - out_dense.float()).abs().max().item()
        assert max_abs_diff == 0.0
        assert torch.equal(out_paged, out_dense)  # attention_bits_equal


def test_dit_forward_over_paged_prefix_bits_equal_dense() -> None:
    """The whole DiT (every layer, two CFG rows of different lengths) sees identical bits."""
    preset = get_preset("tiny")
    model = DitModel(preset.dit, DitParallel.single(), dtype=torch.float32, device=torch.device("cpu"))
    init_seeded_weights(model, 3, torch.device("cpu"))
    layout = PageLayout(preset.kv_geometry(page_size=8), num_shards=1, shard=0)
    dense_rows = [random_prefix(preset, 21, seed=1), random_prefix(preset, 9, seed=2)]
    pool = torch.full((layout.pool_bytes(6),), 0xAB, dtype=torch.uint8)
    placement = [[4, 0, 2], [5, 1]]
    for row, pages in zip(dense_rows, placement, strict=True):
        write_by_offsets(pool, layout, pages, row)
    paged_rows = [
        read_prefix(pool, layout, pages, row[0][0].shape[1])
        for row, pages in zip(dense_rows, placement, strict=True)
    ]
    latents = torch.randn(2, preset.dit.latent_channels, 8, 8, generator=torch.Generator().manual_seed(5))
    t = 0.7
    out_paged = model(latents, t, paged_rows)
    out_dense = model(latents, t, dense_rows)
    assert (out_paged - out_dense).abs().max().item() == 0.0
    assert torch.equal(out_paged, out_dense)


def test_write_prefix_places_bytes_where_layout_offsets_say() -> None:
    layout = _layout("bfloat16", page_size=8, num_shards=4, shard=3)
    prefix = _dense_prefix(layout, 19, seed=4)
    by_offsets = torch.zeros(layout.pool_bytes(5), dtype=torch.uint8)
    write_by_offsets(by_offsets, layout, [4, 0, 2], prefix)
    by_helper = torch.full_like(by_offsets, 0x5A)
    for page in (4, 0, 2):  # write_prefix zeroes the pages it writes, other pages untouched
        pool_pages(by_helper, layout)[page].zero_()
    write_prefix(by_helper, layout, [4, 0, 2], prefix)
    mask = torch.zeros(5, dtype=torch.bool)
    mask[[0, 2, 4]] = True
    pages_a = by_offsets.view(5, -1)
    pages_b = by_helper.view(5, -1)
    assert torch.equal(pages_a[mask], pages_b[mask])
    assert bool((pages_b[~mask] == 0x5A).all())


def test_single_page_row_is_a_view_into_the_pool() -> None:
    layout = _layout("float32", page_size=16)
    pool = torch.zeros(layout.pool_bytes(4), dtype=torch.uint8)
    write_prefix(pool, layout, [2], _dense_prefix(layout, 10, seed=0))
    k, v = read_prefix(pool, layout, [2], 10)[1]
    start, end = pool.data_ptr(), pool.data_ptr() + pool.numel()
    assert start <= k.data_ptr() < end and start <= v.data_ptr() < end
    assert k.data_ptr() == start + layout.offset(2, 1, K_INDEX, 0, 0)


def test_typed_pool_reads_like_a_byte_pool() -> None:
    layout = _layout("float32", page_size=4)
    pool = torch.zeros(layout.pool_bytes(3), dtype=torch.uint8)
    write_prefix(pool, layout, [2, 0], _dense_prefix(layout, 6, seed=8))
    typed = pool.view(torch.float32)
    for (a, b), (c, d) in zip(
        read_prefix(pool, layout, [2, 0], 6), read_prefix(typed, layout, [2, 0], 6), strict=True
    ):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_read_prefix_rejects_bad_requests() -> None:
    layout = _layout("float32", page_size=16)
    pool = torch.zeros(layout.pool_bytes(4), dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs 2 pages"):
        read_prefix(pool, layout, [0], 17)
    with pytest.raises(ValueError, match="out of range"):
        read_prefix(pool, layout, [0, 4], 17)
    with pytest.raises(ValueError, match="does not match"):
        read_prefix(pool.view(torch.int32), layout, [0], 3)
    with pytest.raises(ValueError, match="whole number"):
        read_prefix(pool[:-4], layout, [0], 3)


def _reference_attention(q, k, v, prefixes, num_valid):
    """Textbook softmax attention in fp64 with explicit GQA grouping, only the valid keys."""
    rows, hq, n, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(rows, hq, n, d, dtype=torch.float64)
    for r, (pk, pv) in enumerate(prefixes):
        for h in range(hq):
            kv_head = h // (hq // hkv)
            keys = torch.cat([pk[kv_head], k[r, kv_head, :num_valid]]).double()
            values = torch.cat([pv[kv_head], v[r, kv_head, :num_valid]]).double()
            scores = q[r, h].double() @ keys.T / math.sqrt(d)
            out[r, h] = torch.softmax(scores, dim=-1) @ values
    return out


@pytest.mark.parametrize("lengths", [(7, 7), (7, 3), (0, 5)])
@pytest.mark.parametrize("num_valid", [12, 9])
def test_prefix_attention_matches_textbook_attention(lengths: tuple[int, int], num_valid: int) -> None:
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, 12, 8, generator=gen)
    k = torch.randn(2, 2, 12, 8, generator=gen)
    v = torch.randn(2, 2, 12, 8, generator=gen)
    prefixes = [(torch.randn(2, t, 8, generator=gen), torch.randn(2, t, 8, generator=gen)) for t in lengths]
    out = prefix_attention(q, k, v, prefixes, num_valid=num_valid)
    expected = _reference_attention(q, k, v, prefixes, num_valid)
    np.testing.assert_allclose(out.double().numpy(), expected.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_kv_fill_from_page_blocks_equals_per_layer_copies(dtype: str) -> None:
    """read_prefix's rows carry the tensor their layers are views of (one page: a view into the
    pool; several: the gathered copy). Filling the step buffers from those blocks (one copy per
    row) gives the same bits as copying each layer's (k, v) alone, padding zeroed, the mask the
    same, even over buffers that held another request's prefixes before."""
    from kvrelay.models.paged_attention import PrefixBlock, PrefixKv

    layout = _layout(dtype, page_size=16)
    g = layout.geometry
    pool = torch.randint(
        0, 256, (layout.pool_bytes(8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    rows_spec = [(5, [3]), (37, [6, 1, 4]), (16, [0])]
    for n, pages in rows_spec:
        write_by_offsets(pool, layout, pages, _dense_prefix(layout, n, seed=n))
    rows = [read_prefix(pool, layout, pages, n) for n, pages in rows_spec]
    assert all(isinstance(row, PrefixBlock) for row in rows)
    plain = [[(k.clone(), v.clone()) for k, v in row] for row in rows]

    def filled(prefix_rows: list) -> PrefixKv:
        kv = PrefixKv.allocate(3, layout.heads_per_shard, 48, 10, g.head_dim, num_layers=g.num_layers,
                               dtype=DTYPES[dtype], device="cpu", masked=True)
        kv.block.fill_(7.0)  # what an earlier denoise left there
        kv.fill(prefix_rows, num_valid=9)
        return kv

    by_block, by_layer = filled(rows), filled(plain)
    prefix = by_block.block[..., :48, :]
    assert torch.equal(prefix, by_layer.block[..., :48, :])
    assert torch.equal(by_block.mask, by_layer.mask)
    for r, (n, _) in enumerate(rows_spec):
        assert not bool(prefix[:, :, r, :, n:].any())  # zero padding after each row's tokens
        for layer in range(g.num_layers):
            assert torch.equal(by_block.keys[layer][r, :, :n], plain[r][layer][0])
            assert torch.equal(by_block.values[layer][r, :, :n], plain[r][layer][1])
