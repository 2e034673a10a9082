"""Packing: an AR rank copies its KV of each row into its staging buffer, already in each
destination rank's page layout (DESIGN.md section 4), so that each planned write is one
contiguous staging range sent as one segment per destination page run.

Staging order of one write (the planner's contract): [page][layer][k|v][head][token][head_dim]
over the heads the source holds and the destination needs; token slots past the row's length
in its last page are zero. This module never decides what to send: the plan does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvrelay.transfer.layout import KvGeometry, PageLayout
from kvrelay.transfer.planner import PlannedWrite, RowSpec, head_overlap, staging_bytes

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def _typed_range(buf: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("buffers must be 1-D contiguous torch.uint8 tensors")
    if start < 0 or start + nbytes > buf.numel():
        raise ValueError(f"range [{start}, {start + nbytes}) outside a {buf.numel()}-byte buffer")
    return buf[start : start + nbytes].view(dtype)


def pack_staging(
    staging: torch.Tensor,
    kv_by_row: Mapping[int, torch.Tensor],
    geometry: KvGeometry,
    src_shards: int,
    dst_shards: int,
    rows: Sequence[RowSpec],
    plan: Sequence[PlannedWrite],
    src_rank: int,
) -> int:
    """Fill `staging` with every write of `src_rank` in `plan`; returns the bytes packed.

    `kv_by_row[row]` is this rank's KV of that row, [num_layers, 2, heads_local, T, head_dim]
    (heads_local = num_kv_heads / src_shards, K after RoPE), on any device: the copy into
    `staging` (host memory registered with the transport) is the device-to-host copy.
    """
    g = geometry
    dtype = TORCH_DTYPES[g.dtype]
    heads_local = g.num_kv_heads // src_shards
    s_lo, _ = g.head_range(src_shards, src_rank)
    by_row = {r.row: r for r in rows}
    need = staging_bytes(plan, src_rank)
    if staging.numel() < need:
        raise ValueError(f"staging buffer holds {staging.numel()} bytes; rank {src_rank} needs {need}")
    packed = 0
    for w in plan:
        if w.src_rank != src_rank:
            continue
        spec = by_row[w.row]
        kv = kv_by_row[w.row]
        expect = (g.num_layers, 2, heads_local, spec.num_tokens, g.head_dim)
        if tuple(kv.shape) != expect:
            raise ValueError(f"row {w.row}: KV shape {tuple(kv.shape)} != expected {expect}")
        if kv.dtype != dtype:
            raise ValueError(f"row {w.row}: KV dtype {kv.dtype} != geometry dtype {g.dtype}")
        # A CFG-parallel DiT's rank g * dst_shards + s holds head shard s (planner.plan_transfer).
        overlap = head_overlap(g, src_shards, dst_shards, w.src_rank, w.dst_rank % dst_shards)
        assert overlap is not None, "the planner only emits writes between overlapping shards"
        lo, hi = overlap
        x = kv[:, :, lo - s_lo : hi - s_lo]
        npages, ps = len(spec.page_ids), g.page_size
        out = _typed_range(staging, w.staging_start, w.num_bytes, dtype).view(
            npages, g.num_layers, 2, hi - lo, ps, g.head_dim
        )
        full, rem = divmod(spec.num_tokens, ps)
        if full:
            body = x[:, :, :, : full * ps].reshape(g.num_layers, 2, hi - lo, full, ps, g.head_dim)
            out[:full].copy_(body.permute(3, 0, 1, 2, 4, 5))
        if rem:
            out[full, :, :, :, :rem].copy_(x[:, :, :, full * ps :])
            # Padding is zeroed, not left stale: checksums and bit-identity cover whole pages.
            out[full, :, :, :, rem:].zero_()
        packed += w.num_bytes
    return packed


def read_row(region: torch.Tensor, layout: PageLayout, spec: RowSpec) -> torch.Tensor:
    """A row's KV as held by one destination rank: [num_layers, 2, heads_per_shard, T, head_dim].

    Reads pages back out of a pool region (the inverse of packing plus the plan's copies); used by
    tests and by receivers that want the prefix as one tensor.
    """
    g = layout.geometry
    if region.numel() % layout.page_bytes:
        raise ValueError(f"region of {region.numel()} bytes is not whole pages of {layout.page_bytes}")
    num_pages = region.numel() // layout.page_bytes
    pages = _typed_range(region, 0, region.numel(), TORCH_DTYPES[g.dtype]).view(
        num_pages, g.num_layers, 2, layout.heads_per_shard, g.page_size, g.head_dim
    )
    picked = pages[list(spec.page_ids)]
    merged = picked.permute(1, 2, 3, 0, 4, 5).reshape(
        g.num_layers, 2, layout.heads_per_shard, len(spec.page_ids) * g.page_size, g.head_dim
    )
    return merged[:, :, :, : spec.num_tokens].contiguous()
