"""KV geometry and the HND page layout of one DiT rank's pool (DESIGN.md section 3).

Owns the arithmetic that maps (page, layer, k|v, head, token) to a byte offset inside one
rank's page region. Pure and deterministic: it must never import torch, gRPC or anything
that touches memory, because the broker (which imports no torch) plans transfers with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

DTypeName = Literal["bfloat16", "float16", "float32"]
ITEMSIZE: Final[dict[str, int]] = {"bfloat16": 2, "float16": 2, "float32": 4}

# Index of K and V along the `k|v` axis of a page and of an AR rank's KV tensor.
K_INDEX: Final = 0
V_INDEX: Final = 1


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Shape of the KV cache; AR and DiT of one deployment agree on all fields but page_size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DTypeName
    page_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KvGeometry.{name} must be a positive int, got {value!r}")
        if self.dtype not in get_args(DTypeName):
            raise ValueError(f"KvGeometry.dtype must be one of {get_args(DTypeName)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers and all kv heads."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def pages_for(self, num_tokens: int) -> int:
        """Pages one row of `num_tokens` occupies on every rank (the last one zero-padded)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def head_range(self, num_shards: int, shard: int) -> tuple[int, int]:
        """Global kv heads [start, stop) that head shard `shard` of `num_shards` holds."""
        if num_shards <= 0 or self.num_kv_heads % num_shards != 0:
            raise ValueError(
                f"{num_shards} shards do not divide num_kv_heads={self.num_kv_heads}: "
                "tensor_parallel_size (times sequence_parallel_size on the DiT) must divide it"
            )
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        per = self.num_kv_heads // num_shards
        return shard * per, (shard + 1) * per


@dataclass(frozen=True, slots=True)
class PageLayout:
    """One rank's pool: [page][layer][k|v][head_local][token][head_dim] (HND).

    Heads-major inside a page so that the heads one rank needs are one contiguous run per
    (layer, k|v), and a whole page is contiguous when the source holds every head of the rank.
    """

    geometry: KvGeometry
    num_shards: int
    shard: int

    def __post_init__(self) -> None:
        # Validates divisibility and the shard index with a message naming the cause.
        self.geometry.head_range(self.num_shards, self.shard)

    @property
    def heads_per_shard(self) -> int:
        return self.geometry.num_kv_heads // self.num_shards

    @property
    def head_start(self) -> int:
        return self.shard * self.heads_per_shard

    @property
    def head_block_bytes(self) -> int:
        """Bytes of one head's tokens inside one (page, layer, k|v): page_size * head_dim."""
        g = self.geometry
        return g.page_size * g.head_dim * g.itemsize

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of all local heads of one (page, layer, k|v)."""
        return self.heads_per_shard * self.head_block_bytes

    @property
    def page_bytes(self) -> int:
        return self.geometry.num_layers * 2 * self.kv_block_bytes

    def offset(self, page: int, layer: int, kv: int, head_local: int, token: int = 0) -> int:
        """Byte offset of (page, layer, k|v, local head, token) from the start of the pool."""
        g = self.geometry
        if page < 0:
            raise ValueError(f"page must be >= 0, got {page}")
        if not 0 <= layer < g.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {g.num_layers})")
        if kv not in (K_INDEX, V_INDEX):
            raise ValueError(f"kv must be {K_INDEX} (K) or {V_INDEX} (V), got {kv}")
        if not 0 <= head_local < self.heads_per_shard:
            raise ValueError(f"head_local {head_local} out of range [0, {self.heads_per_shard})")
        if not 0 <= token < g.page_size:
            raise ValueError(f"token {token} out of range [0, {g.page_size})")
        return (
            page * self.page_bytes
            + (layer * 2 + kv) * self.kv_block_bytes
            + head_local * self.head_block_bytes
            + token * g.head_dim * g.itemsize
        )

    def pool_bytes(self, num_pages: int) -> int:
        """Size of a region holding `num_pages` pages of this rank."""
        return num_pages * self.page_bytes
