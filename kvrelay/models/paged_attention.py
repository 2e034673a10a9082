"""Attention of image tokens over an AR prefix that lives in one rank's KV pages.

Owns two things: reading a row's prefix K/V out of a rank's page pool (the HND layout of
kvrelay.transfer.layout, page by page in the row's page order), and the attention of image
queries over ``[prefix K/V of the layer | own K/V]`` with grouped-query heads. Reading never
writes the pool and never keeps a reference past the call's result, so the page memory's owner
decides alone when pages are reused. ``write_prefix`` is the inverse, for in-process handoff
(colocated runs) and for tests; transfers write pages through the transfer plane instead.

Exactness contract (DESIGN.md section 3, the seed's ``attention_bits_equal``): K/V read back from
pages are the very bits that were written, and ``prefix_attention`` is a pure function of its
inputs, so a paged prefix and the same prefix held densely give bit-identical outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kvrelay.models.layers import torch_dtype
from kvrelay.transfer.layout import K_INDEX, V_INDEX, PageLayout

# One layer's prefix for one row: (k, v), each [heads_local, T, head_dim]; K is after RoPE.
LayerKv = tuple[torch.Tensor, torch.Tensor]


def pool_pages(pool: torch.Tensor, layout: PageLayout) -> torch.Tensor:
    """Zero-copy typed view ``[num_pages, layers, 2, heads_local, page_size, head_dim]`` of a pool.

    ``pool`` is one rank's region: a flat uint8 tensor (what transports register) or a tensor
    already of the geometry's dtype. The strides come from the layout's own offsets and are
    checked against ``PageLayout.offset`` at the far corner, so a layout change that this view
    does not follow fails here instead of reading the wrong bytes.
    """
    g = layout.geometry
    dtype = torch_dtype(g.dtype)
    if not pool.is_contiguous():
        raise ValueError("page pool must be contiguous (it is registered memory)")
    flat = pool.reshape(-1)
    if flat.dtype == torch.uint8:
        if flat.numel() % g.itemsize:
            raise ValueError(f"pool of {flat.numel()} bytes is not a multiple of itemsize {g.itemsize}")
        flat = flat.view(dtype)
    elif flat.dtype != dtype:
        raise ValueError(f"pool dtype {flat.dtype} does not match the geometry's {g.dtype}")
    pool_bytes = flat.numel() * g.itemsize
    if pool_bytes % layout.page_bytes:
        raise ValueError(
            f"pool of {pool_bytes} bytes is not a whole number of {layout.page_bytes}-byte pages"
        )
    num_pages = pool_bytes // layout.page_bytes
    item = g.itemsize
    strides_bytes = (
        layout.page_bytes,
        2 * layout.kv_block_bytes,
        layout.kv_block_bytes,
        layout.head_block_bytes,
        g.head_dim * item,
        item,
    )
    shape = (num_pages, g.num_layers, 2, layout.heads_per_shard, g.page_size, g.head_dim)
    corner = tuple(n - 1 for n in shape)
    # The strided formula must agree with the layout's offsets (the last head_dim element sits one
    # item after the corner token's start); checked once per view, costs nothing.
    expected = layout.offset(*corner[:5]) + corner[5] * item
    if sum(i * s for i, s in zip(corner, strides_bytes, strict=True)) != expected:
        raise AssertionError("pool_pages strides disagree with PageLayout.offset: the page layout changed")
    return flat.as_strided(shape, tuple(s // item for s in strides_bytes))


def _page_index(page_ids: Sequence[int], num_pages: int, device: torch.device) -> torch.Tensor | slice:
    ids = [int(p) for p in page_ids]
    for p in ids:
        if not 0 <= p < num_pages:
            raise ValueError(f"page id {p} out of range for a pool of {num_pages} pages")
    # A contiguous ascending run (what the broker prefers) is a plain slice: no index tensor.
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return slice(ids[0], ids[0] + len(ids))
    return torch.tensor(ids, dtype=torch.long, device=device)


class PrefixBlock(list[LayerKv]):
    """A row's per-layer ``(k, v)`` list that also carries the tensor they are all views of,
    ``block`` ``[layers, 2 (K, V), heads, T', head_dim]`` (T' >= the row's T tokens): what lets a
    consumer copy every layer of the row at once (``PrefixKv.fill``)."""

    def __init__(self, layers: list[LayerKv], block: torch.Tensor) -> None:
        super().__init__(layers)
        self.block = block


def read_prefix(
    pool: torch.Tensor, layout: PageLayout, page_ids: Sequence[int], num_tokens: int
) -> list[LayerKv]:
    """One row's prefix from a rank's pages: per layer ``(k, v)``, each ``[heads_local, T, head_dim]``.

    Tokens ``[i * page_size, (i + 1) * page_size)`` of the row live in ``page_ids[i]``. A row that
    fits in one page comes back as views into the pool (zero copy; valid while the pages are
    reserved). A longer row is gathered into one fresh tensor for all layers at once (one copy),
    since its tokens are strided across pages and attention needs them adjacent.
    """
    g = layout.geometry
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    needed = g.pages_for(num_tokens)
    if len(page_ids) != needed:
        raise ValueError(
            f"a row of {num_tokens} tokens needs {needed} pages of {g.page_size} tokens, got {len(page_ids)} page ids"
        )
    pages = pool_pages(pool, layout)
    if num_tokens == 0:
        empty = pages.new_empty((layout.heads_per_shard, 0, g.head_dim))
        return [(empty, empty) for _ in range(g.num_layers)]
    index = _page_index(page_ids, pages.shape[0], pages.device)
    if len(page_ids) == 1:
        one = pages[index][0]  # [layers, 2, heads, page_size, head_dim], a view
        return PrefixBlock([
            (one[layer, K_INDEX, :, :num_tokens], one[layer, V_INDEX, :, :num_tokens])
            for layer in range(g.num_layers)
        ], one)
    # [layers, 2, heads, n_pages, page_size, head_dim]: token axis = (page, slot) in row order.
    by_head = pages.permute(1, 2, 3, 0, 4, 5)
    if isinstance(index, slice):
        gathered = by_head[:, :, :, index].contiguous()
    else:
        gathered = torch.index_select(by_head, 3, index)
    tokens = gathered.reshape(
        g.num_layers, 2, layout.heads_per_shard, len(page_ids) * g.page_size, g.head_dim
    )
    return PrefixBlock([
        (tokens[layer, K_INDEX, :, :num_tokens], tokens[layer, V_INDEX, :, :num_tokens])
        for layer in range(g.num_layers)
    ], tokens)


def write_prefix(
    pool: torch.Tensor, layout: PageLayout, page_ids: Sequence[int], prefix: Sequence[LayerKv]
) -> None:
    """Write one row's prefix (this rank's heads, per layer ``(k, v)`` ``[heads_local, T, head_dim]``)
    into its pages; the tail of the last page is zeroed, as a transfer of whole pages leaves it."""
    g = layout.geometry
    if len(prefix) != g.num_layers:
        raise ValueError(f"prefix has {len(prefix)} layers, geometry has {g.num_layers}")
    num_tokens = prefix[0][0].shape[1]
    if len(page_ids) != g.pages_for(num_tokens):
        raise ValueError(
            f"a row of {num_tokens} tokens needs {g.pages_for(num_tokens)} pages, got {len(page_ids)}"
        )
    pages = pool_pages(pool, layout)
    expected = (layout.heads_per_shard, num_tokens, g.head_dim)
    for layer, (k, v) in enumerate(prefix):
        for src in (k, v):
            if tuple(src.shape) != expected:
                raise ValueError(f"layer {layer} prefix shape {tuple(src.shape)} != {expected}")
    if not page_ids:
        return
    # One gather-free copy for the whole row instead of one per page, layer and k|v: the prefix
    # is laid out as pages ([page][layer][k|v][head][slot][dim], zero tail) and scattered by id.
    n, ps = len(page_ids), g.page_size
    kv = torch.stack([torch.stack((k, v)) for k, v in prefix]).to(device=pages.device, dtype=pages.dtype)
    padded = kv.new_zeros(g.num_layers, 2, layout.heads_per_shard, n * ps, g.head_dim)
    padded[..., :num_tokens, :] = kv
    blocks = padded.view(g.num_layers, 2, layout.heads_per_shard, n, ps, g.head_dim).permute(3, 0, 1, 2, 4, 5)
    index = torch.as_tensor([int(p) for p in page_ids], dtype=torch.long, device=pages.device)
    pages.index_copy_(0, index, blocks)


# Folded queries (query heads of a kv head x image tokens) per attention call when a caller asks to
# be called between chunks (``gqa_attention(between=...)``: the DiT's per-chunk cancel check on the
# CPU). Each query's softmax is its own, so chunks give the same bits as one call (tested).
ATTENTION_CHUNK = 4096


def attention_chunks(folded_queries: int) -> int:
    """How many calls ``gqa_attention(between=...)`` makes for ``folded_queries`` (group * N)."""
    return max(1, -(-folded_queries // ATTENTION_CHUNK))


def gqa_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    between: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Non-causal grouped-query attention without expanding K/V to the query heads.

    ``q``: ``[rows, heads_q, N, head_dim]``; ``keys``/``values``: ``[rows, heads_kv, L, head_dim]``;
    ``mask``: ``None`` or bool ``[rows, 1, 1, L]`` (True = attend). Query head h reads kv head
    ``h // (heads_q / heads_kv)`` (the Llama grouping): the group's queries are folded into the
    token axis (``[rows, heads_kv, group * N, head_dim]``), which is the same softmax per query,
    so K/V are read once per kv head instead of being copied ``group`` times.

    ``between`` (eager only): the folded queries run in ``attention_chunks`` calls of
    ``ATTENTION_CHUNK``, and ``between()`` is called before every call but the first (it may raise
    to abandon the attention: the DiT's cancel check on the CPU, where one call can take seconds).
    """
    rows, heads_q, n, head_dim = q.shape
    heads_kv = keys.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} not a multiple of kv heads {heads_kv}")
    group = heads_q // heads_kv
    folded = q.reshape(rows, heads_kv, group * n, head_dim)
    if between is None or attention_chunks(group * n) == 1:
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask)
    else:
        out = torch.empty_like(folded)
        for start in range(0, group * n, ATTENTION_CHUNK):
            if start:
                between()
            stop = start + ATTENTION_CHUNK
            out[:, :, start:stop] = F.scaled_dot_product_attention(
                folded[:, :, start:stop], keys, values, attn_mask=mask
            )
    return out.reshape(rows, heads_q, n, head_dim)


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefixes: Sequence[LayerKv],
    *,
    num_valid: int | None = None,
) -> torch.Tensor:
    """Attention of image queries over ``[prefix K/V | own K/V]``, grouped-query, non-causal.

    ``q``: ``[rows, heads_q, N, head_dim]``; ``k``/``v``: ``[rows, heads_kv, N, head_dim]`` (the image
    tokens' own, after RoPE); ``prefixes[r]``: row r's ``(k, v)`` ``[heads_kv, T_r, head_dim]`` for this
    layer. ``heads_q`` must be a multiple of ``heads_kv``; query head h reads kv head
    ``h // (heads_q / heads_kv)``, the grouping of the AR, whose heads the pages hold. Every image
    token sees the whole prefix and every image token (BAGEL's full attention within an image).
    ``num_valid < N`` masks the trailing image keys: padding added so tokens split evenly over
    sequence parallel ranks must not be attended to.

    The one-shot form of what the DiT does per step (``PrefixKv``: prefix copied once per denoise,
    own K/V written into its tail each step): rows of different prefix lengths are padded to the
    longest and the padding masked, so all rows run as one call.
    """
    rows, heads_q, n, head_dim = q.shape
    heads_kv = k.shape[1]
    if len(prefixes) != rows:
        raise ValueError(f"{len(prefixes)} prefixes for {rows} rows")
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} not a multiple of kv heads {heads_kv}")
    for r, (pk, pv) in enumerate(prefixes):
        if pk.shape[0] != heads_kv or pk.shape[2] != head_dim or pk.shape != pv.shape:
            raise ValueError(
                f"row {r} prefix shape {tuple(pk.shape)}/{tuple(pv.shape)} does not match "
                f"{heads_kv} kv heads x head_dim {head_dim}"
            )
    if num_valid is None:
        num_valid = n
    if not 0 < num_valid <= n:
        raise ValueError(f"num_valid={num_valid} out of range (0, {n}]")
    kv = PrefixKv.allocate(rows, heads_kv, max(pk.shape[1] for pk, _ in prefixes), n, head_dim,
                           num_layers=1, dtype=k.dtype, device=k.device)
    kv.fill([[p] for p in prefixes], num_valid=num_valid)
    keys, values = kv.with_own(0, k, v)
    return gqa_attention(q, keys, values, kv.mask)


class PrefixKv:
    """Per-layer K/V buffers of one denoise: ``[rows, heads_kv, P + N, head_dim]``, slots ``[0, P)``
    the rows' prefixes (copied once, by ``fill``; a row shorter than P is zero-padded and masked),
    slots ``[P, P + N)`` the image tokens' own K/V, overwritten in place every step (``with_own``).

    So a step reads the prefix straight from these buffers, with no concatenation, and the
    buffers' addresses never change between steps (what a captured CUDA graph needs). ``mask``
    is ``None`` when every slot is valid, else bool ``[rows, 1, 1, P + N]`` (True = attend).
    """

    def __init__(self, block: torch.Tensor, prefix_slots: int, mask: torch.Tensor | None) -> None:
        # One buffer [layers, 2 (K, V), rows, heads_kv, P + N, head_dim]: each layer's keys and
        # values are contiguous views of it, and one copy per row fills every layer's prefix.
        self.block = block
        self.keys = [block[layer, K_INDEX] for layer in range(block.shape[0])]
        self.values = [block[layer, V_INDEX] for layer in range(block.shape[0])]
        self.prefix_slots = prefix_slots
        self.mask = mask

    @classmethod
    def allocate(cls, rows: int, heads_kv: int, prefix_slots: int, image_tokens: int, head_dim: int, *,
                 num_layers: int, dtype: torch.dtype, device: torch.device | str,
                 masked: bool = False) -> PrefixKv:
        """Zeroed buffers; ``masked`` keeps a mask tensor even when every slot is valid (a graph
        captured over these buffers must always read the same mask tensor)."""
        length = prefix_slots + image_tokens
        block = torch.zeros(num_layers, 2, rows, heads_kv, length, head_dim, dtype=dtype, device=device)
        mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device) if masked else None
        return cls(block, prefix_slots, mask)

    @property
    def rows(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def image_tokens(self) -> int:
        return int(self.keys[0].shape[2]) - self.prefix_slots

    def fill(self, prefix_rows: Sequence[Sequence[LayerKv]], *, num_valid: int | None = None) -> None:
        """Copy each row's per-layer prefix ``(k, v)`` ``[heads_kv, T_r, head_dim]`` into the prefix
        slots (zeros after T_r) and set the mask: prefix slots past T_r and image slots past
        ``num_valid`` (SP padding) are not attended to. The image slots keep whatever they hold
        until the next ``with_own``."""
        if len(prefix_rows) != self.rows:
            raise ValueError(f"{len(prefix_rows)} prefix rows for {self.rows} buffer rows")
        n, p = self.image_tokens, self.prefix_slots
        num_valid = n if num_valid is None else num_valid
        lengths = [int(row[0][0].shape[1]) for row in prefix_rows]
        if max(lengths, default=0) > p:
            raise ValueError(f"prefix of {max(lengths)} tokens does not fit {p} prefix slots")
        for r, row in enumerate(prefix_rows):
            t = lengths[r]
            source = row.block if isinstance(row, PrefixBlock) else None
            if source is not None and source.shape[-2] >= t:
                # Every layer's K and V of the row in one copy (a GPU runs 2 kernels per row, not
                # 4 per row and layer: on an H200 that was 2.7 ms of host time per denoise).
                self.block[:, :, r, :, :t].copy_(source[..., :t, :])
            else:
                for layer, (pk, pv) in enumerate(row):
                    self.keys[layer][r, :, :t].copy_(pk)
                    self.values[layer][r, :, :t].copy_(pv)
            self.block[:, :, r, :, t:p].zero_()
        keep = torch.ones(self.rows, 1, 1, p + n, dtype=torch.bool)
        for r, t in enumerate(lengths):
            keep[r, ..., t:p] = False
        keep[..., p + num_valid :] = False
        if self.mask is not None:
            self.mask.copy_(keep)  # in place: a captured graph keeps reading the same tensor
        elif not bool(keep.all()):
            self.mask = keep.to(self.keys[0].device)

    def with_own(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's image K/V ``[rows, heads_kv, N, head_dim]`` into the layer's image slots;
        returns the layer's full (keys, values)."""
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, self.prefix_slots :].copy_(k)
        values[:, :, self.prefix_slots :].copy_(v)
        return keys, values
