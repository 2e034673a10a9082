"""Transfer plans: which bytes of which AR rank land where in which DiT rank (DESIGN.md section 4).

The broker runs `plan_transfer` at reservation to know the exact set of expected writes, and
the AR runs the same function to execute them, so the function is pure and deterministic: no
torch, no gRPC, no clock, no randomness, output order fixed by input order.

Offsets:
- `Segment.dst_offset` is a byte offset in the destination rank's pool (`PageLayout.offset`).
- `Segment.src_offset` is a byte offset in the source rank's staging buffer, which holds every
  write of that source rank concatenated in plan order, each write already in the destination
  page layout. A write's segments are therefore contiguous in the staging buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.transfer.layout import KvGeometry, PageLayout

RowIndex = int
RankIndex = int
PageId = int

# CFG rows of a request: row 0 the prompt, row 1 the negative prompt (guidance_scale > 1).
MAX_CFG_ROWS = 2


def cfg_group(row: RowIndex, cfg_parallel: int) -> int:
    """The CFG group of a CFG-parallel DiT that receives and computes `row`: group `row % cfg`.

    Its ranks are `group * dst_shards + shard`, and its pages are a page-id space of their own
    (the broker keeps one page pool per group). With `cfg_parallel` 1 every row is group 0's.
    """
    if cfg_parallel < 1:
        raise ValueError(f"cfg_parallel={cfg_parallel} must be at least 1")
    return row % cfg_parallel


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One CFG row of a request: its token count and the pages reserved for it (same ids on every
    rank of the row's CFG group: every rank of the replica unless it is CFG-parallel)."""

    row: RowIndex
    num_tokens: int
    page_ids: tuple[PageId, ...]


@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous copy of `length` bytes from staging `src_offset` to pool `dst_offset`."""

    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class PlannedWrite:
    """Everything one source rank sends one destination rank for one row."""

    row: RowIndex
    src_rank: RankIndex
    dst_rank: RankIndex
    segments: tuple[Segment, ...]

    @property
    def num_bytes(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def staging_start(self) -> int:
        """Offset of this write's first byte in its source rank's staging buffer."""
        return self.segments[0].src_offset if self.segments else 0


def head_overlap(
    geometry: KvGeometry, src_shards: int, dst_shards: int, src_rank: RankIndex, dst_rank: RankIndex
) -> tuple[int, int] | None:
    """Global kv heads [start, stop) that `src_rank` holds and `dst_rank` needs, or None."""
    s_lo, s_hi = geometry.head_range(src_shards, src_rank)
    d_lo, d_hi = geometry.head_range(dst_shards, dst_rank)
    lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
    return (lo, hi) if lo < hi else None


def _validate_rows(geometry: KvGeometry, rows: Sequence[RowSpec], cfg_parallel: int) -> None:
    seen_rows: set[int] = set()
    # A page id is a page of one CFG group's ranks: rows of different groups may share ids.
    seen_pages: dict[tuple[int, int], int] = {}
    for spec in rows:
        if spec.row in seen_rows:
            raise ValueError(f"row {spec.row} appears twice in the plan input")
        seen_rows.add(spec.row)
        if spec.num_tokens <= 0:
            raise ValueError(f"row {spec.row} has num_tokens={spec.num_tokens}; a row needs at least one token")
        need = geometry.pages_for(spec.num_tokens)
        if len(spec.page_ids) != need:
            raise ValueError(
                f"row {spec.row}: {spec.num_tokens} tokens need {need} pages of {geometry.page_size} "
                f"tokens, but {len(spec.page_ids)} page ids were reserved"
            )
        group = cfg_group(spec.row, cfg_parallel)
        for page in spec.page_ids:
            if page < 0:
                raise ValueError(f"row {spec.row}: negative page id {page}")
            if (group, page) in seen_pages:
                # Two writes into one page would overwrite each other: the reservation is broken.
                raise ValueError(
                    f"page {page} is reserved for both row {seen_pages[group, page]} and row {spec.row}"
                )
            seen_pages[group, page] = spec.row


def _write_pieces(
    layout: PageLayout, spec: RowSpec, head_lo_local: int, num_heads: int
) -> list[tuple[int, int]]:
    """(dst_offset, length) of one write in staging order: page, layer, k|v, then the head run."""
    g = layout.geometry
    page_bytes = layout.page_bytes
    if head_lo_local == 0 and num_heads == layout.heads_per_shard:
        # The write covers every head the destination stores: each page is one contiguous piece
        # (the same bytes as the per-(layer, k|v) runs below, already merged).
        return [(page * page_bytes, page_bytes) for page in spec.page_ids]
    layout.offset(0, 0, 0, head_lo_local)  # validates the head range once, for the arithmetic below
    run = num_heads * layout.head_block_bytes
    kv_block = layout.kv_block_bytes
    head_off = head_lo_local * layout.head_block_bytes
    blocks = [block * kv_block + head_off for block in range(g.num_layers * 2)]  # (layer, k|v) order
    return [(page * page_bytes + off, run) for page in spec.page_ids for off in blocks]


def _coalesce(pieces: list[tuple[int, int]], src_start: int) -> tuple[Segment, ...]:
    # Staging bytes are contiguous by construction, so adjacent pieces merge whenever their
    # destinations are contiguous too: whole pages of consecutive page ids become one segment.
    segments: list[Segment] = []
    src = src_start
    cur_dst, cur_len, cur_src = -1, 0, src_start
    for dst, length in pieces:
        if cur_len and cur_dst + cur_len == dst:
            cur_len += length
        else:
            if cur_len:
                segments.append(Segment(cur_src, cur_dst, cur_len))
            cur_dst, cur_len, cur_src = dst, length, src
        src += length
    if cur_len:
        segments.append(Segment(cur_src, cur_dst, cur_len))
    return tuple(segments)


def plan_transfer(
    geometry: KvGeometry,
    src_shards: int,
    dst_shards: int,
    rows: Sequence[RowSpec],
    *,
    cfg_parallel: int = 1,
) -> tuple[PlannedWrite, ...]:
    """Every write needed to move `rows` from `src_shards` AR head shards to `dst_shards` DiT head shards.

    `src_shards` is the AR tensor_parallel_size; `dst_shards` the DiT tp * sp (each Ulysses SP
    rank needs its head shard of the whole prefix). Order: rows as given, then source rank, then
    destination rank; only pairs whose head ranges overlap get a write. Whole pages are written
    (the tail of a row's last page is zero padding).

    CFG-parallel (`cfg_parallel` > 1): the DiT's ranks form `cfg_parallel` groups of `dst_shards`
    ranks each (rank = group * dst_shards + shard) and CFG row r is computed by group
    r % cfg_parallel only (`cfg_group`), so its KV goes to that group's ranks and to no other: a rank
    receives 1/cfg_parallel of the rows. Page ids are per group, so rows of different groups may
    name the same ids.
    """
    geometry.head_range(src_shards, 0)
    geometry.head_range(dst_shards, 0)
    if not 1 <= cfg_parallel <= MAX_CFG_ROWS:
        raise ValueError(f"cfg_parallel={cfg_parallel} must be in [1, {MAX_CFG_ROWS}] (one group per CFG row)")
    _validate_rows(geometry, rows, cfg_parallel)
    cursor = [0] * src_shards
    writes: list[PlannedWrite] = []
    for spec in rows:
        for src in range(src_shards):
            for dst in range(dst_shards):
                overlap = head_overlap(geometry, src_shards, dst_shards, src, dst)
                if overlap is None:
                    continue
                layout = PageLayout(geometry, dst_shards, dst)
                lo, hi = overlap
                pieces = _write_pieces(layout, spec, lo - layout.head_start, hi - lo)
                segments = _coalesce(pieces, cursor[src])
                cursor[src] += sum(length for _, length in pieces)
                group = cfg_group(spec.row, cfg_parallel)
                writes.append(PlannedWrite(spec.row, src, group * dst_shards + dst, segments))
    return tuple(writes)


def staging_bytes(plan: Sequence[PlannedWrite], src_rank: RankIndex) -> int:
    """Size of the staging buffer `src_rank` needs for `plan` (all its writes, concatenated)."""
    return sum(w.num_bytes for w in plan if w.src_rank == src_rank)


def max_segments_per_peer(plan: Sequence[PlannedWrite], src_rank: RankIndex) -> int:
    """Largest number of segments `src_rank` sends one destination rank (Mooncake queues per peer)."""
    per_dst: dict[int, int] = {}
    for w in plan:
        if w.src_rank == src_rank:
            per_dst[w.dst_rank] = per_dst.get(w.dst_rank, 0) + len(w.segments)
    return max(per_dst.values(), default=0)
