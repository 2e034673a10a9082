"""The built-in DiT: a mixture-of-transformers image expert over an AR prefix, its decoder, and
the runner that the DiT service's rank workers call.

Owns the model math (DESIGN.md section 9): image latents are patchified (patch 2) into tokens
that, in every layer, attend over ``[AR prefix K/V of that layer, read from the pages | own K/V]``
(BAGEL's generation expert); image RoPE positions start at the row's prefix length; the timestep
conditions every block through adaLN modulation. Tensor parallel over heads (Megatron column/row
linears) and Ulysses sequence parallel (image tokens split over SP ranks, all-to-all to heads
around attention). Weights are random from a seed, generated whole per tensor and then sharded,
so every TP/SP size sees the same model.

It never owns page memory, tickets or processes: the caller hands in each CFG row's prefix as
per-layer ``(k, v)`` (views from ``kvrelay.models.paged_attention.read_prefix``) for this rank's
head shard, and must keep those pages reserved until ``denoise`` returns.

Rank mapping: world rank ``r = tp_rank * sp + sp_rank``. After the Ulysses all-to-all, rank r
computes kv heads ``[r * H_kv / world, (r + 1) * H_kv / world)``: head shard r of ``world`` shards,
which is exactly ``PageLayout(geometry, num_shards=world, shard=r)``, the pages rank r receives.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvrelay.models.checkpoint import CheckpointError, check_float, require_dir, scan_tensors
from kvrelay.models.fp8 import check_quantization, quantize_fp8_
from kvrelay.models.layers import (
    ParallelAttention,
    RMSNorm,
    apply_rotary,
    compile_enabled,
    compiled,
    init_std,
    rope_cos_sin,
)
from kvrelay.models.loader import full_state, load_full_state, open_safetensors
from kvrelay.models.moe import RoutedExperts, build_mlp
from kvrelay.models.paged_attention import LayerKv, PrefixBlock, PrefixKv, attention_chunks, gqa_attention
from kvrelay.models.parallel import ColumnParallelLinear, RowParallelLinear, TpGroup
from kvrelay.models.presets import DitConfig, ModelPreset, get_preset
from kvrelay.models.sampler import (
    StepCallback,
    VelocityFn,
    cfg_rows,
    combine_cfg,
    euler_sample,
    flow_timesteps,
    initial_noise,
)
from kvrelay.models.ulysses import heads_to_seq, seq_to_heads
from kvrelay.transfer.layout import PageLayout
from kvrelay.transfer.planner import cfg_group

# One CFG row's prefix on this rank: per layer (k, v), each [heads_local, T, head_dim], K after RoPE.
PrefixRow = Sequence[LayerKv]

TIMESTEP_FREQ_DIM = 256  # sinusoidal timestep features before the MLP (DiT's frequency_embedding_size)


class DenoiseCancelled(Exception):
    """Raised on every rank whose own step callback did not raise, when another rank's did:
    all ranks of a replica stop after the same step, so no rank waits in a collective forever."""


class StepAborted(DenoiseCancelled):
    """Raised out of an eager (CPU) step at one of its abort points, on every rank at the same
    point, when the agreed abort check (``agreed_abort``) says every request of the step is
    cancelled: the step's partial result is dropped, and no rank is left inside a collective.
    The points: before each block (``chunk`` 0), and inside a block's attention between its query
    chunks (``chunk`` c: after c chunks of ``paged_attention.ATTENTION_CHUNK`` folded queries)."""

    def __init__(self, block: int, blocks: int, chunk: int = 0) -> None:
        where = f"before block {block}" if chunk == 0 else f"in block {block} after attention chunk {chunk}"
        super().__init__(f"step aborted {where} of {blocks} blocks")
        self.block = block
        self.chunk = chunk


class _AbortPoints:
    """The abort points of one block of an eager step: ``start()`` before it, then the block's
    attention calls ``self()`` between its query chunks; each asks the (agreed) check and raises
    ``StepAborted`` where it says True."""

    def __init__(self, abort: AbortCheck, block: int, blocks: int) -> None:
        self.abort, self.block, self.blocks, self.chunk = abort, block, blocks, 0

    def start(self) -> None:
        if self.abort():
            raise StepAborted(self.block, self.blocks)

    def __call__(self) -> None:
        self.chunk += 1
        if self.abort():
            raise StepAborted(self.block, self.blocks, self.chunk)


# abort() -> True to abandon the running step at the next block boundary. The checks a step makes
# are collective on a multi-rank replica (``agreed_abort``): every rank calls it at the same blocks.
AbortCheck = Callable[[], bool]
# abort(active request indices) -> True when every one of them is to stop now (``denoise_batch``).
BatchAbortCheck = Callable[[list[int]], bool]


# ---------------------------------------------------------------------------------------------
# Parallel layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DitParallel:
    """This rank's place in the DiT replica: ``rank = tp_rank * sp + sp_rank`` of ``world = tp * sp``."""

    rank: int
    world: int
    tp: TpGroup
    sp: TpGroup
    # CFG-parallel: this rank's CFG group (``cfg.rank`` = the CFG row it computes) among the ranks
    # of equal ``rank`` in every group; the replica has ``world * cfg.world_size`` ranks.
    cfg: TpGroup = TpGroup.single()

    @property
    def replica_rank(self) -> int:
        return self.cfg.rank * self.world + self.rank

    @property
    def replica_world(self) -> int:
        return self.cfg.world_size * self.world

    @classmethod
    def single(cls) -> DitParallel:
        return cls(0, 1, TpGroup.single(), TpGroup.single())

    @classmethod
    def build(cls, rank: int, world: int, tp: int, sp: int, cfg: int = 1) -> DitParallel:
        """Create the TP and SP subgroups. Collective: every rank of the default process group
        must call it with the same sizes (torch.distributed.new_group is collective).
        ``cfg`` > 1: ``world = cfg * tp * sp`` ranks in ``cfg`` groups, see ``_build_cfg``."""
        if cfg > 1:
            return cls._build_cfg(rank, world, tp, sp, cfg)
        if tp < 1 or sp < 1 or tp * sp != world:
            raise ValueError(f"tp={tp} x sp={sp} must equal world={world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for world {world}")
        if world == 1:
            return cls.single()
        if not dist.is_initialized() or dist.get_world_size() != world:
            raise RuntimeError(f"world={world} needs an initialized default process group of that size")
        tp_rank, sp_rank = divmod(rank, sp)
        tp_group, sp_group = TpGroup(tp_rank, tp, None), TpGroup(sp_rank, sp, None)
        if tp == 1:
            tp_group, sp_group = TpGroup.single(), TpGroup(sp_rank, sp, None)
        elif sp == 1:
            tp_group, sp_group = TpGroup(tp_rank, tp, None), TpGroup.single()
        else:
            # Every rank creates every subgroup in the same order (new_group is collective).
            for s in range(sp):
                g = dist.new_group([t * sp + s for t in range(tp)])
                if s == sp_rank:
                    tp_group = TpGroup(tp_rank, tp, g)
            for t in range(tp):
                g = dist.new_group([t * sp + s for s in range(sp)])
                if t == tp_rank:
                    sp_group = TpGroup(sp_rank, sp, g)
        return cls(rank, world, tp_group, sp_group)

    @classmethod
    def _build_cfg(cls, rank: int, world: int, tp: int, sp: int, cfg: int) -> DitParallel:
        """CFG-parallel: replica rank ``c * tp * sp + r`` is rank r (``r = tp_rank * sp + sp_rank``)
        of CFG group c, which computes CFG row c; its TP/SP groups stay inside group c, and the
        ranks of equal r across groups form its CFG group (one all-gather per step combines)."""
        inner = tp * sp
        if tp < 1 or sp < 1 or inner * cfg != world:
            raise ValueError(f"cfg={cfg} x tp={tp} x sp={sp} must equal world={world}")
        if not dist.is_initialized() or dist.get_world_size() != world:
            raise RuntimeError(f"world={world} needs an initialized default process group of that size")
        c, local = divmod(rank, inner)
        tp_rank, sp_rank = divmod(local, sp)
        tp_group, sp_group, row_group = TpGroup.single(), TpGroup.single(), TpGroup.single()
        # Every rank creates every subgroup in the same order (new_group is collective).
        for g in range(cfg):
            base = g * inner
            for s in range(sp if tp > 1 else 0):
                handle = dist.new_group([base + t * sp + s for t in range(tp)])
                if (g, s) == (c, sp_rank):
                    tp_group = TpGroup(tp_rank, tp, handle)
            for t in range(tp if sp > 1 else 0):
                handle = dist.new_group([base + t * sp + s for s in range(sp)])
                if (g, t) == (c, tp_rank):
                    sp_group = TpGroup(sp_rank, sp, handle)
        for r in range(inner):
            handle = None if inner == 1 else dist.new_group([g * inner + r for g in range(cfg)])
            if r == local:
                row_group = TpGroup(c, cfg, handle)
        return cls(local, inner, tp_group, sp_group, row_group)

    def page_layout(self, preset: ModelPreset, page_size: int) -> PageLayout:
        """The layout of the pages this rank receives: head shard ``rank`` of ``world``."""
        return PageLayout(preset.kv_geometry(page_size), num_shards=self.world, shard=self.rank)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def timestep_features(t: torch.Tensor, dim: int = TIMESTEP_FREQ_DIM) -> torch.Tensor:
    """Sinusoidal features [rows, dim] of flow times t in [0, 1] (scaled to DiT's 0..1000 range), fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_2d(grid_h: int, grid_w: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed 2D sin-cos position embedding [grid_h * grid_w, dim] in raster order, fp32.

    1D RoPE over the raster order (positions after the prefix) does not tell the model which
    tokens are vertical neighbours; half the channels encode the row, half the column.
    """
    if dim % 4:
        raise ValueError(f"hidden={dim} must be a multiple of 4 for the 2D position embedding")
    quarter = dim // 4
    omega = 1.0 / (10000.0 ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter))

    def axis(n: int) -> torch.Tensor:
        a = torch.arange(n, dtype=torch.float32, device=device)[:, None] * omega[None, :]
        return torch.cat([a.sin(), a.cos()], dim=-1)  # [n, dim/2]

    rows = axis(grid_h)[:, None, :].expand(grid_h, grid_w, dim // 2)
    cols = axis(grid_w)[None, :, :].expand(grid_h, grid_w, dim // 2)
    return torch.cat([rows, cols], dim=-1).reshape(grid_h * grid_w, dim)


class DitAttention(ParallelAttention):
    """ParallelAttention's TP projections (rank holds its heads; o_proj all-reduces) with QK-norm,
    per-row RoPE positions, Ulysses all-to-all, and MoT attention over each row's AR prefix."""

    def __init__(self, cfg: DitConfig, tp: TpGroup, sp: TpGroup, *, dtype: torch.dtype, device: torch.device):
        super().__init__(
            cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp, dtype=dtype, device=device
        )
        if self.num_kv_heads_local % sp.world_size:
            raise ValueError(
                f"num_kv_heads={cfg.num_kv_heads} does not split over tp={tp.world_size} x sp={sp.world_size} ranks"
            )
        self.sp = sp
        # QK-norm as in BAGEL: keeps attention logits O(1) for the image tokens' own q/k.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype=dtype, device=device)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        prefix_slots: int,
        mask: torch.Tensor | None,
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        rows, tokens, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        # Sequence shards -> head shards: this rank now has every image token for the kv heads of
        # its page shard, so the prefix it holds is exactly the prefix its heads attend over.
        q, k, v = seq_to_heads(q, self.sp), seq_to_heads(k, self.sp), seq_to_heads(v, self.sp)
        # This step's own K/V go into the image slots of the layer's buffers, after the prefix
        # that was copied there once per denoise: attention reads the prefix in place.
        keys[:, :, prefix_slots:].copy_(k)
        values[:, :, prefix_slots:].copy_(v)
        # `between`: the eager CPU step's abort check between query chunks (``_AbortPoints``).
        attended = gqa_attention(q, keys, values, mask) if between is None else gqa_attention(
            q, keys, values, mask, between=between
        )
        out = heads_to_seq(attended, self.sp)
        projected: torch.Tensor = self.o_proj(
            out.transpose(1, 2).reshape(rows, tokens, self.num_heads_local * self.head_dim)
        )
        return projected


class DitBlock(nn.Module):
    """Pre-norm transformer block with adaLN modulation (shift, scale, gate for attention and MLP).
    The MLP is dense SwiGLU, or routed experts + a shared expert for a MoE preset (models/moe.py)."""

    def __init__(
        self, cfg: DitConfig, tp: TpGroup, sp: TpGroup, *, dtype: torch.dtype, device: torch.device,
        expert_parallel: bool = False,
    ):
        super().__init__()
        # Replicated on every rank: it acts on the full hidden state, which TP keeps replicated.
        self.modulation = nn.Linear(cfg.hidden, 6 * cfg.hidden, dtype=dtype, device=device)
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
        self.attn = DitAttention(cfg, tp, sp, dtype=dtype, device=device)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
        self.mlp = build_mlp(
            cfg.hidden, cfg.mlp, tp, num_experts=cfg.num_experts, top_k=cfg.experts_top_k,
            expert_mlp=cfg.expert_mlp, expert_parallel=expert_parallel, dtype=dtype, device=device,
        )

    def forward(
        self,
        x: torch.Tensor,
        modulation: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        prefix_slots: int,
        mask: torch.Tensor | None,
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """``modulation`` ``[1, 6 * hidden]``: this block's ``self.modulation(silu(c))`` for the
        step's flow time, computed once per t (``DitModel.conditioning``) and broadcast over rows.
        ``between``: called between the attention's query chunks (eager CPU steps, to cancel)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation.unsqueeze(1).chunk(6, dim=-1)
        h = self.attn_norm(x) * (1 + scale1) + shift1
        if between is None:
            attended = self.attn(h, cos, sin, keys, values, prefix_slots, mask)
        else:
            attended = self.attn(h, cos, sin, keys, values, prefix_slots, mask, between)
        x = x + gate1 * attended
        h = self.mlp_norm(x) * (1 + scale2) + shift2
        mlp_out: torch.Tensor = self.mlp(h)
        out: torch.Tensor = x + gate2 * mlp_out
        return out


@dataclass(frozen=True, slots=True)
class StepConditioning:
    """What a step's flow time ``t`` contributes, for ONE row (every row of a step shares t):
    each block's adaLN modulation ``blocks[i] = blocks.i.modulation(silu(c))`` ``[1, 6 * hidden]``
    and the final ``final_modulation(silu(c))`` ``[1, 2 * hidden]``, ``c`` the time embedding.
    Both are views of one contiguous buffer ``flat``, so a captured step's static copy is refilled
    with one device copy (``copy_``)."""

    flat: torch.Tensor  # [(6 * num_layers + 2) * hidden]
    blocks: torch.Tensor  # [num_layers, 1, 6 * hidden], view of flat
    final: torch.Tensor  # [1, 2 * hidden], view of flat

    @classmethod
    def empty(cls, num_layers: int, hidden: int, *, dtype: torch.dtype, device: torch.device) -> StepConditioning:
        """A zeroed buffer (a captured step's static conditioning)."""
        split = num_layers * 6 * hidden
        flat = torch.zeros(split + 2 * hidden, dtype=dtype, device=device)
        return cls(flat, flat[:split].view(num_layers, 1, 6 * hidden), flat[split:].view(1, 2 * hidden))

    def copy_(self, other: StepConditioning) -> None:
        """Overwrite in place with ``other``'s values (one device copy, no host synchronisation)."""
        self.flat.copy_(other.flat)


class DitModel(nn.Module):
    """Velocity model: ``forward(latents [rows, C, h, w], t: float, prefix_rows) -> v [rows, C, h, w]``.

    Every rank passes the full latents (the sampler keeps them replicated); the rank embeds only
    its sequence shard of the tokens and all-gathers the output tokens over its SP group. All rows
    of a step share the flow time t, so its adaLN modulation is computed once for one row
    (``conditioning(t)``) and broadcast; ``DitRunner`` caches it per t.
    """

    def __init__(
        self, cfg: DitConfig, parallel: DitParallel, *, dtype: torch.dtype, device: torch.device,
        expert_parallel: bool = False,
    ):
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        self.dtype = dtype
        self.device = device
        patch_dim = cfg.latent_channels * cfg.patch_size**2
        self.patch_embed = nn.Linear(patch_dim, cfg.hidden, dtype=dtype, device=device)
        self.time_in = nn.Linear(TIMESTEP_FREQ_DIM, cfg.hidden, dtype=dtype, device=device)
        self.time_out = nn.Linear(cfg.hidden, cfg.hidden, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(
            DitBlock(cfg, parallel.tp, parallel.sp, dtype=dtype, device=device, expert_parallel=expert_parallel)
            for _ in range(cfg.num_layers)
        )
        self.final_modulation = nn.Linear(cfg.hidden, 2 * cfg.hidden, dtype=dtype, device=device)
        self.final_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
        self.final_proj = nn.Linear(cfg.hidden, patch_dim, dtype=dtype, device=device)
        # On GPUs every block runs through one torch.compile'd function (inductor fuses the norms,
        # adaLN modulation, RoPE, gates and SwiGLU into a few kernels; the matmuls stay cuBLAS).
        # Not for MoE: its routing has data-dependent shapes.
        self.compiled_block: Callable[..., torch.Tensor] | None = (
            compiled(_run_block)
            if device.type == "cuda" and parallel.world == 1 and compile_enabled() and not cfg.is_moe
            else None
        )

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[rows, C, h, w] -> [rows, (h/p)*(w/p), C*p*p], raster order of patches."""
        rows, c, h, w = latents.shape
        p = self.cfg.patch_size
        x = latents.reshape(rows, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(rows, (h // p) * (w // p), c * p * p)

    def unpatchify(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        rows = tokens.shape[0]
        p, c = self.cfg.patch_size, self.cfg.latent_channels
        x = tokens.reshape(rows, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(rows, c, h, w)

    def image_tokens(self, h: int, w: int) -> tuple[int, int, int]:
        """(tokens, tokens padded to a multiple of the SP size, tokens on this rank) of latents h x w."""
        p, sp = self.cfg.patch_size, self.parallel.sp.world_size
        n = (h // p) * (w // p)
        n_padded = -(-n // sp) * sp
        return n, n_padded, n_padded // sp

    def allocate_inputs(
        self, rows: int, h: int, w: int, prefix_slots: int, *, masked: bool = False
    ) -> DitStepInputs:
        """Zeroed per-denoise buffers for ``rows`` rows of latents h x w and prefixes of at most
        ``prefix_slots`` tokens (see ``prepare``)."""
        cfg = self.cfg
        _, n_padded, n_local = self.image_tokens(h, w)
        heads_kv = cfg.num_kv_heads // self.parallel.world  # after Ulysses: this rank's page shard
        kv = PrefixKv.allocate(
            rows, heads_kv, prefix_slots, n_padded, cfg.head_dim, num_layers=cfg.num_layers,
            dtype=self.dtype, device=self.device, masked=masked,
        )
        rope = torch.zeros(rows, 1, n_local, cfg.head_dim, dtype=self.dtype, device=self.device)
        return DitStepInputs(h, w, kv, rope, rope.clone())

    def prepare(
        self,
        prefix_rows: Sequence[PrefixRow],
        h: int,
        w: int,
        *,
        into: DitStepInputs | None = None,
    ) -> DitStepInputs:
        """What every step of one denoise reads and none changes: each row's prefix copied once
        into per-layer K/V buffers (``PrefixKv``) and the rows' image RoPE tables (token i of row
        r sits at position T_r + i). ``into`` refills existing buffers in place (a captured graph
        reads them); otherwise buffers just large enough are allocated."""
        cfg, sp = self.cfg, self.parallel.sp
        n, _, n_local = self.image_tokens(h, w)
        lo = sp.rank * n_local
        rows = len(prefix_rows)
        if into is None:
            longest = max(int(prefix[0][0].shape[1]) for prefix in prefix_rows)
            into = self.allocate_inputs(rows, h, w, longest)
        elif (into.h, into.w, into.kv.rows) != (h, w, rows):
            raise ValueError(f"inputs for {into.kv.rows} rows of {into.h}x{into.w}, not {rows} of {h}x{w}")
        into.kv.fill(prefix_rows, num_valid=n)
        for r, prefix in enumerate(prefix_rows):
            positions = torch.arange(lo, lo + n_local, device=self.device) + prefix[0][0].shape[1]
            cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype=self.dtype)
            into.cos[r, 0].copy_(cos)
            into.sin[r, 0].copy_(sin)
        return into

    def empty_conditioning(self) -> StepConditioning:
        """A zeroed conditioning buffer of this model's shape, dtype and device."""
        return StepConditioning.empty(self.cfg.num_layers, self.cfg.hidden, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def conditioning(self, t: float) -> StepConditioning:
        """The conditioning of flow time ``t`` (a host float) for one row: the time embedding
        ``c`` (t as fp32, as every row used to see it), then every block's modulation and the final
        one of ``silu(c)``. The modulation linears read ``(6 L + 2) hidden^2`` weights for one
        row, which is why ``DitRunner`` computes this once per distinct t, not every step."""
        out = self.empty_conditioning()
        t_row = torch.full((1,), t, dtype=torch.float32, device=self.device)
        cond = self.time_out(F.silu(self.time_in(timestep_features(t_row).to(self.dtype))))
        cond = F.silu(cond)  # every consumer (adaLN linears) takes silu(c), as in DiT
        for layer, block in enumerate(self.blocks):
            # cast, not isinstance: a block may be wrapped (torch.compile'd module) and still has it.
            out.blocks[layer].copy_(cast(DitBlock, block).modulation(cond))
        out.final.copy_(self.final_modulation(cond))
        return out

    @torch.no_grad()
    def step(
        self, latents: torch.Tensor, cond: StepConditioning, inputs: DitStepInputs, abort: AbortCheck | None = None
    ) -> torch.Tensor:
        """Velocity ``[rows, C, h, w]`` of ``latents`` at the flow time whose conditioning is
        ``cond`` (``conditioning(t)``, shared by every row) over prepared inputs. No host
        synchronisation and fixed buffer addresses: a CUDA graph can capture it.

        ``abort`` (eager steps only, never captured): called before every block and between the
        query chunks of its attention (``paged_attention.ATTENTION_CHUNK``); True raises
        ``StepAborted`` there, so a cancel stops a long CPU step within a fraction of a block, not
        one step. On a multi-rank replica it must be the agreed check (``agreed_abort``) on every
        rank: every rank makes the same checks (same blocks, same chunk count)."""
        cfg, sp = self.cfg, self.parallel.sp
        rows, _, h, w = latents.shape
        if (h, w, rows) != (inputs.h, inputs.w, inputs.kv.rows):
            raise ValueError(f"latents {tuple(latents.shape)} do not match the prepared inputs")
        grid_h, grid_w = h // cfg.patch_size, w // cfg.patch_size
        n, n_padded, n_local = self.image_tokens(h, w)
        lo = sp.rank * n_local

        tokens = self.patchify(latents.to(self.dtype))
        pos = sincos_2d(grid_h, grid_w, cfg.hidden, self.device).to(self.dtype)
        if n_padded != n:
            tokens = F.pad(tokens, (0, 0, 0, n_padded - n))
            pos = F.pad(pos, (0, 0, 0, n_padded - n))
        x = self.patch_embed(tokens[:, lo : lo + n_local]) + pos[lo : lo + n_local]

        kv = inputs.kv
        run_block = self.compiled_block or _run_block
        for layer, block in enumerate(self.blocks):
            if abort is None:
                x = run_block(block, x, cond.blocks[layer], inputs.cos, inputs.sin, kv.keys[layer],
                              kv.values[layer], kv.prefix_slots, kv.mask)
                continue
            points = _AbortPoints(abort, layer, len(self.blocks))
            points.start()
            x = _run_block(block, x, cond.blocks[layer], inputs.cos, inputs.sin, kv.keys[layer], kv.values[layer],
                           kv.prefix_slots, kv.mask, points)

        shift, scale = cond.final.unsqueeze(1).chunk(2, dim=-1)
        out = self.final_proj(self.final_norm(x) * (1 + scale) + shift)
        out = sp.all_gather(out, dim=1)[:, :n]
        return self.unpatchify(out, h, w)

    def idle_blocks(self, abort: AbortCheck, h: int, w: int) -> None:
        """What a rank that computes no rows this step of latents h x w (a CFG-parallel group with
        none) does in place of ``step``: the same abort checks (before each block, between its
        attention's query chunks), so the agreed ones stay in lockstep with the computing ranks."""
        _, n_padded, _ = self.image_tokens(h, w)
        chunks = attention_chunks(self.cfg.num_heads // self.cfg.num_kv_heads * n_padded)
        for layer in range(len(self.blocks)):
            points = _AbortPoints(abort, layer, len(self.blocks))
            points.start()
            for _ in range(chunks - 1):
                points()

    @torch.no_grad()
    def forward(self, latents: torch.Tensor, t: float, prefix_rows: Sequence[PrefixRow]) -> torch.Tensor:
        """One uncached step at flow time ``t`` (a host float) over ``prefix_rows``."""
        rows, _, h, w = latents.shape
        if len(prefix_rows) != rows:
            raise ValueError(f"{len(prefix_rows)} prefix rows for {rows} latent rows")
        return self.step(latents, self.conditioning(t), self.prepare(prefix_rows, h, w))


def _run_block(
    block: nn.Module,
    x: torch.Tensor,
    modulation: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix_slots: int,
    mask: torch.Tensor | None,
    between: Callable[[], None] | None = None,
) -> torch.Tensor:
    if between is None:
        out: torch.Tensor = block(x, modulation, cos, sin, keys, values, prefix_slots, mask)
    else:  # eager only: the abort points of a CPU step
        out = block(x, modulation, cos, sin, keys, values, prefix_slots, mask, between)
    return out


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One request of a batched denoise: its CFG prefix rows (this rank's head shard), guidance
    and noise seed."""

    prefix_rows: Sequence[PrefixRow]
    guidance_scale: float
    seed: int


# on_step(step, total, active request indices) -> indices of the requests to stop now.
BatchStepCallback = Callable[[int, int, list[int]], "set[int] | list[int]"]


@dataclass(slots=True)
class DitStepInputs:
    """One denoise's per-row state that every step reads: prefix K/V buffers and RoPE tables
    ``[rows, 1, n_local, head_dim]`` for latents of ``h`` x ``w``."""

    h: int
    w: int
    kv: PrefixKv
    cos: torch.Tensor
    sin: torch.Tensor


class LatentDecoder(nn.Module):
    """Latents [C, h, w] -> RGB uint8 [8h, 8w, 3]: a conv, three (nearest 2x upsample, conv, SiLU)
    stages with shrinking channels, a conv to RGB, then sigmoid * 255. Random seeded weights: a
    stand-in for a VAE decoder of the same interface, cheap enough for CPU at 2048x2048."""

    CHANNELS = (64, 32, 16, 8)

    def __init__(self, latent_channels: int, *, device: torch.device):
        super().__init__()
        c = self.CHANNELS
        self.conv_in = nn.Conv2d(latent_channels, c[0], 3, padding=1, device=device)
        self.ups = nn.ModuleList(
            nn.Conv2d(c[i], c[i + 1], 3, padding=1, device=device) for i in range(len(c) - 1)
        )
        self.conv_out = nn.Conv2d(c[-1], 3, 3, padding=1, device=device)

    @torch.no_grad()
    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        # fp32 whatever the DiT's dtype: the decoder is small and bf16 would band the colours.
        x = F.silu(self.conv_in(latents.float().unsqueeze(0)))
        for conv in self.ups:
            x = F.silu(conv(F.interpolate(x, scale_factor=2.0, mode="nearest")))
        rgb = torch.sigmoid(self.conv_out(x))[0]
        return (rgb * 255.0).round().to(torch.uint8).permute(1, 2, 0).contiguous()


# ---------------------------------------------------------------------------------------------
# Seeded weights
# ---------------------------------------------------------------------------------------------


def _generator(weight_seed: int, name: str, device: torch.device) -> torch.Generator:
    # One stream per tensor name: a tensor's values depend on (seed, name) only, never on the order
    # of creation, the TP/SP size or which rank builds it.
    digest = hashlib.sha256(f"kvrelay-dit:{weight_seed}:{name}".encode()).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return gen


def _full_normal(
    weight_seed: int, name: str, shape: tuple[int, ...], std: float, device: torch.device
) -> torch.Tensor:
    gen = _generator(weight_seed, name, device)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std


def _expert_normal(
    weight_seed: int, module: str, device: torch.device, key: str, shape: tuple[int, ...], std: float
) -> torch.Tensor:
    return _full_normal(weight_seed, f"{module}.{key}", shape, std, device)


@torch.no_grad()
def init_seeded_weights(module: nn.Module, weight_seed: int, device: torch.device) -> None:
    """Fill every weight from the seed: full (unsharded) tensors, then each rank keeps its shard.

    Draws on ``device`` (a CUDA generator fills a 7B model in seconds; CPU would take minutes), so
    weights are identical across processes and TP/SP sizes on one device type, not across types.
    """
    for name, mod in module.named_modules():
        if isinstance(mod, RoutedExperts):
            mod.fill(functools.partial(_expert_normal, weight_seed, name, device))
        elif isinstance(mod, ColumnParallelLinear | RowParallelLinear):
            full = _full_normal(
                weight_seed,
                f"{name}.weight",
                (mod.out_features, mod.in_features),
                init_std(mod.in_features),
                device,
            )
            bias = torch.zeros(mod.out_features, device=device) if mod.bias is not None else None
            mod.load_full(full.to(mod.weight.dtype), None if bias is None else bias.to(mod.weight.dtype))
        elif isinstance(mod, nn.Linear):
            mod.weight.copy_(
                _full_normal(
                    weight_seed, f"{name}.weight", tuple(mod.weight.shape), init_std(mod.in_features), device
                )
            )
            if mod.bias is not None:
                mod.bias.zero_()
        elif isinstance(mod, nn.Conv2d):
            fan_in = mod.in_channels * mod.kernel_size[0] * mod.kernel_size[1]
            # He gain: SiLU halves the variance per layer, and a decoder that fades to grey would
            # hide whether the DiT produced anything.
            mod.weight.copy_(
                _full_normal(
                    weight_seed,
                    f"{name}.weight",
                    tuple(mod.weight.shape),
                    math.sqrt(2.0) * init_std(fan_in),
                    device,
                )
            )
            if mod.bias is not None:
                mod.bias.copy_(_full_normal(weight_seed, f"{name}.bias", tuple(mod.bias.shape), 0.1, device))
    for param in module.parameters():
        param.requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# Checkpoints: full (unsharded) tensors in safetensors (loader.full_state), sharded on load like
# the seeded weights (loader.load_full_state)
# ---------------------------------------------------------------------------------------------

DIT_CHECKPOINT_FILE = "dit.safetensors"


# ---------------------------------------------------------------------------------------------
# Runner: the API the DiT service's rank workers call
# ---------------------------------------------------------------------------------------------


MAX_GRAPHS = 16  # captured step shapes kept per runner (each holds its K/V buffers)
# Cached step conditionings per runner (distinct flow times t; BAGEL-7B shape: ~1.2 MB each).
MAX_CONDITIONINGS = 64


class StepGraph:
    """One DiT step captured as a CUDA graph for a shape bucket (rows, latent h x w, prefix
    slots): static latents, conditioning (``StepConditioning``) and per-denoise inputs
    (``DitStepInputs``, refilled in place by ``DitModel.prepare(into=...)``); ``run(x, t)`` copies
    the step's latents and the conditioning of t (from ``conditioning``, the runner's cache; a
    device copy) in and replays. The kernels are exactly the eager step's over the same buffers,
    so the output is bit-identical to ``model.step`` (tests/dit_model/test_cuda_graphs.py)."""

    def __init__(
        self, model: DitModel, rows: int, lat_h: int, lat_w: int, slots: int, pool: Any,
        conditioning: Callable[[float], StepConditioning],
    ) -> None:
        self.model = model
        self.conditioning = conditioning
        self.inputs = model.allocate_inputs(rows, lat_h, lat_w, slots, masked=True)
        self.x = torch.zeros(rows, model.cfg.latent_channels, lat_h, lat_w, dtype=model.dtype, device=model.device)
        self.cond = model.empty_conditioning()
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernel selection and workspaces happen outside the capture
                model.step(self.x, self.cond, self.inputs)
        torch.cuda.current_stream(model.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = model.step(self.x, self.cond, self.inputs)

    def run(self, x: torch.Tensor, t: float) -> torch.Tensor:
        self.x.copy_(x)
        self.cond.copy_(self.conditioning(t))
        self.graph.replay()
        return self.out


def _t_bits(t: float) -> int:
    """The exact float64 bits of a host flow time (the conditioning cache's key: 0.5 and the next
    float after it are different keys, as are 0.0 and -0.0)."""
    bits: int = struct.unpack("<q", struct.pack("<d", float(t)))[0]
    return bits


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there and tests compare bits), bf16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


class DitRunner:
    """One rank's DiT: builds the model from a preset and seed, denoises over CFG prefix rows,
    decodes. With ``world > 1`` the default process group must already be initialized (the rank
    worker harness does it) and every rank must make the same calls in the same order.
    """

    def __init__(
        self,
        preset: ModelPreset | str,
        *,
        rank: int = 0,
        world: int = 1,
        tp: int = 1,
        sp: int = 1,
        weight_seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        timestep_shift: float = 1.0,
        checkpoint: str | Path | None = None,
        cuda_graphs: bool = True,
        prefix_bucket: int | None = None,
        expert_parallel: bool = False,
        cfg_parallel: int = 1,
        quantization: str | None = None,
    ) -> None:
        self.preset = get_preset(preset) if isinstance(preset, str) else preset
        self.cfg = self.preset.dit
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else default_dtype(self.device)
        # "fp8": the blocks' qkv, o, gate/up and down linears run as FP8 GEMMs (kvrelay.models.fp8).
        self.quantization = quantization
        check_quantization(quantization, self.device, self.dtype)
        if quantization is not None and self.cfg.is_moe:
            raise ValueError(f"quantization {quantization}: the MoE preset {self.preset.name!r} is not supported (dense DiTs only)")
        self.parallel = DitParallel.build(rank, world, tp, sp, cfg_parallel)
        self.timestep_shift = timestep_shift
        on_gpu = self.device.type == "cuda"
        # Prefix slots rounded up to a bucket on GPUs, so one captured step serves every prompt
        # length of the bucket (the padding is masked); exact lengths on CPU.
        self.prefix_bucket = prefix_bucket if prefix_bucket is not None else (64 if on_gpu else 0)
        # Graphs need a fixed stream of kernels: one process, no collectives inside the step.
        # MoE routing syncs with the host (per-expert token counts): no graphs for it either.
        self.use_graphs = cuda_graphs and on_gpu and self.parallel.world == 1 and not self.cfg.is_moe
        # Experts sharded over the TP group (models/moe.py); a dense preset has none to shard.
        self.expert_parallel = expert_parallel and self.cfg.is_moe and self.parallel.tp.world_size > 1
        self._graphs: OrderedDict[tuple[int, int, int, int], StepGraph] = OrderedDict()
        self._graph_pool: Any = None
        # (step, block, chunk) at which the last denoise / denoise_batch abandoned a step (every
        # request of it cancelled mid-step, ``StepAborted``); None when it did not.
        self.last_abort: tuple[int, int, int] | None = None
        # Step conditionings by (float64 bits of t, dtype, device), LRU; see ``conditioning``.
        self._conditionings: OrderedDict[tuple[int, torch.dtype, torch.device], StepConditioning] = OrderedDict()
        self.model = DitModel(
            self.cfg, self.parallel, dtype=self.dtype, device=self.device, expert_parallel=self.expert_parallel
        ).eval()
        init_seeded_weights(self.model, weight_seed, self.device)
        self.decoder = LatentDecoder(self.cfg.latent_channels, device=self.device).eval()
        init_seeded_weights(self.decoder, weight_seed, self.device)
        if checkpoint is not None:
            self.load_checkpoint(checkpoint)
        elif self.quantization is not None:
            self._quantize()

    def _quantize(self) -> None:
        """FP8 copies of the blocks' big linears; their bf16 sources are freed (kvrelay.models.fp8),
        and on a GPU the freed memory goes back to the driver (other processes may use it)."""
        quantize_fp8_(self.model)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write the DiT and its decoder as full tensors (`dit.safetensors` + `config.json` naming
        the preset's shape). Only an unsharded (world size 1), unquantized runner holds whole
        tensors: a quantized one freed the bf16 weights of its big linears, and writing their FP8
        rounding back as bf16 would pass a lossy copy off as the original, so it refuses."""
        if self.parallel.world != 1:
            raise ValueError("save_checkpoint needs the unsharded (world size 1) DiT")
        if self.quantization is not None:
            raise ValueError(
                f"save_checkpoint: this runner is quantized ({self.quantization}) and freed the bf16 weights of "
                "its big linears; save from a runner without quantization (same weight_seed or checkpoint)"
            )
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v for k, v in full_state(self.model).items()}
        tensors.update({f"decoder.{k}": v for k, v in full_state(self.decoder).items()})
        save_file(tensors, str(out / DIT_CHECKPOINT_FILE), metadata={"preset": self.preset.name})
        (out / "config.json").write_text(json.dumps({"kvrelay_dit_preset": self.preset.name}, indent=2))
        return out

    def load_checkpoint(self, directory: str | Path) -> None:
        """Load weights written by `save_checkpoint` (any TP/SP size: each rank keeps its shard).
        A quantized runner quantizes each big linear's tensor straight into its FP8 buffers, in
        place (captured step graphs stay valid), one matrix at a time: the bf16 model is never
        whole on the device."""
        path = require_dir(directory) / DIT_CHECKPOINT_FILE
        if not path.is_file():
            raise CheckpointError(
                f"no {DIT_CHECKPOINT_FILE} in {directory} (a preset DiT's path holds what "
                "DitRunner.save_checkpoint writes; a BAGEL release directory is model.format: bagel)"
            )
        # Headers first (a truncated or corrupt file, a non-float tensor, a tensor this preset
        # does not have, as a deeper model's extra blocks, are named before any weight changes).
        stored = scan_tensors([path])
        known = {f"model.{n}" for n, _ in self.model.named_parameters()}
        known |= {f"decoder.{n}" for n, _ in self.decoder.named_parameters()}
        for key in sorted(stored):
            if key not in known:
                raise CheckpointError(
                    f"{path.name} has tensor {key!r}, which preset {self.preset.name!r} does not have: "
                    f"a checkpoint of another preset?"
                )
            check_float(key, stored[key])
        with open_safetensors(path) as f:
            tensors = {key: f.get_tensor(key) for key in stored}
        self.clear_conditionings()  # also when loading fails halfway: weights may have changed
        load_full_state(self.model, tensors, "model.")
        if self.quantization is not None:
            self._quantize()  # first load (from __init__): quantize and free; later ones: loaded into FP8
        load_full_state(self.decoder, tensors, "decoder.")

    def conditioning(self, t: float) -> StepConditioning:
        """The step conditioning of flow time ``t`` (``DitModel.conditioning``), cached by the
        exact host value of t (its float64 bits) and the model's dtype/device, LRU over
        ``MAX_CONDITIONINGS`` entries: t is shared by every row of a step and the schedule repeats
        across requests, so the weight-read-bound modulation linears run once per distinct t, not
        every step. Entries live on the device; a hit costs no device work and no host sync.
        Anything that changes the model's weights must call ``clear_conditionings``."""
        key = (_t_bits(t), self.model.dtype, self.model.device)
        cached = self._conditionings.get(key)
        if cached is None:
            cached = self.model.conditioning(float(t))
            self._conditionings[key] = cached
            while len(self._conditionings) > MAX_CONDITIONINGS:
                self._conditionings.popitem(last=False)
        else:
            self._conditionings.move_to_end(key)
        return cached

    def clear_conditionings(self) -> None:
        """Drop every cached step conditioning (call after changing the model's weights)."""
        self._conditionings.clear()

    def _on_device(self, row: PrefixRow) -> PrefixRow:
        """The row on this model's device; a PrefixBlock already there stays one (so filling the
        step buffers copies each row once, not once per layer)."""
        if isinstance(row, PrefixBlock):
            at = row.block.device
            if at.type == self.device.type and (self.device.index is None or at.index == self.device.index):
                return row
        return [(k.to(self.device), v.to(self.device)) for k, v in row]

    def prefix_slots(self, longest: int) -> int:
        """Prefix slots for a batch whose longest prefix has ``longest`` tokens (its bucket on GPUs)."""
        b = self.prefix_bucket
        return -(-longest // b) * b if b else longest

    def block_abort(self, abort: AbortCheck | None) -> AbortCheck | None:
        """The per-block abort check of this rank's eager steps: ``abort`` agreed over the replica
        (``agreed_abort``: one tiny all-reduce per block when world > 1), or None where steps are
        not interrupted: no ``abort`` given, or not on the CPU (on GPUs a step is tens of ms, and a
        captured graph cannot be interrupted; a per-block host sync would only slow every step).
        Every rank of a replica must pass an ``abort`` or none."""
        if abort is None or self.device.type != "cpu":
            return None
        return agreed_abort(abort, self.parallel.replica_rank, self.parallel.replica_world)

    def stepper(
        self, prefix_rows: Sequence[PrefixRow], lat_h: int, lat_w: int, abort: AbortCheck | None = None
    ) -> VelocityFn:
        """The velocity function ``velocity(x [rows, C, h, w], t: float) -> v`` of one denoise over
        ``prefix_rows`` (on the model's device): the prefixes are copied once into the step's K/V
        buffers, then each call runs one step at the host flow time t (every row at the same t;
        its conditioning from the cache), as a CUDA graph replay when graphs are on (the returned
        tensor is then the graph's output buffer, valid until the next call). ``abort`` (from
        ``block_abort``) is checked before every block of an eager step (``DitModel.step``); a
        captured step ignores it."""
        longest = max(int(row[0][0].shape[1]) for row in prefix_rows)
        slots = self.prefix_slots(longest)
        if self.use_graphs:
            graph = self.step_graph(len(prefix_rows), lat_h, lat_w, slots)
            self.model.prepare(prefix_rows, lat_h, lat_w, into=graph.inputs)
            return graph.run
        inputs = self.model.allocate_inputs(len(prefix_rows), lat_h, lat_w, slots, masked=bool(self.prefix_bucket))
        self.model.prepare(prefix_rows, lat_h, lat_w, into=inputs)

        def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
            return self.model.step(x, self.conditioning(t), inputs, abort)

        return velocity

    def warm_up(self, width: int = 512, height: int = 512) -> None:
        """On a GPU: compile the blocks and capture the step graphs of the common buckets now (two
        prefix buckets, so the compiled code is already shape-generic), not on the first request."""
        if self.device.type != "cuda":
            return
        dtype = getattr(torch, self.preset.dtype)
        lat_h, lat_w = self.cfg.latent_size(width, height)
        small, large = self.prefix_slots(1), self.prefix_slots(self.prefix_slots(1) + 1)
        # Two prefix buckets, then twice the rows (two requests batched): every later shape reuses
        # the shape-generic code and only captures its graph.
        for lengths in ((small, 1), (large, 1), (small, 1, small, 1)):
            rows = [random_prefix(self.preset, n, seed=n, dtype=dtype, device=self.device) for n in lengths]
            rows = [shard_prefix(row, self.parallel.world, self.parallel.rank) for row in rows]
            step = self.stepper(rows, lat_h, lat_w)
            x = torch.zeros(len(rows), self.cfg.latent_channels, lat_h, lat_w, dtype=self.dtype, device=self.device)
            step(x, 0.5)
        torch.cuda.synchronize(self.device)

    def step_graph(self, rows: int, lat_h: int, lat_w: int, slots: int) -> StepGraph:
        """The captured step of one shape bucket, captured on first use (LRU, ``MAX_GRAPHS``)."""
        key = (rows, lat_h, lat_w, slots)
        graph = self._graphs.get(key)
        if graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.popitem(last=False)
            graph = StepGraph(self.model, rows, lat_h, lat_w, slots, self._graph_pool, self.conditioning)
            self._graphs[key] = graph
        self._graphs.move_to_end(key)
        return graph

    @property
    def heads_local(self) -> int:
        """kv heads of this rank's page shard (what each prefix (k, v) must have on dim 0)."""
        return self.preset.num_kv_heads // self.parallel.world

    def page_layout(self, page_size: int) -> PageLayout:
        return self.parallel.page_layout(self.preset, page_size)

    def local_rows(self, guidance_scale: float) -> list[int]:
        """The CFG rows this rank reads and computes: every row of the request, or with
        CFG-parallel only those of its group (``cfg_group``): row c on group c, and none on group 1
        for a one-row request (guidance_scale 1), whose group then only joins the combine."""
        cfg = self.parallel.cfg
        return [r for r in range(cfg_rows(guidance_scale)) if cfg_group(r, cfg.world_size) == cfg.rank]

    def _check_prefix(self, prefix_rows: Sequence[PrefixRow], guidance_scale: float) -> None:
        rows = len(self.local_rows(guidance_scale))
        if len(prefix_rows) != rows:
            where = ""
            if self.parallel.cfg.world_size > 1:
                where = f" on CFG group {self.parallel.cfg.rank} of {self.parallel.cfg.world_size}"
            raise ValueError(
                f"guidance_scale={guidance_scale} needs {rows} CFG row(s){where} (row 0 prompt, row 1 negative), "
                f"got {len(prefix_rows)}"
            )
        want = (self.heads_local, self.preset.head_dim)
        for r, row in enumerate(prefix_rows):
            if len(row) != self.cfg.num_layers:
                raise ValueError(f"row {r}: prefix has {len(row)} layers, the model {self.cfg.num_layers}")
            for layer, (k, v) in enumerate(row):
                if k.dim() != 3 or (k.shape[0], k.shape[2]) != want or k.shape != v.shape:
                    raise ValueError(
                        f"row {r} layer {layer}: prefix k/v {tuple(k.shape)}/{tuple(v.shape)} must be "
                        f"[{want[0]} heads of shard {self.parallel.rank}/{self.parallel.world}, T, {want[1]}]"
                    )
                if k.shape[1] != row[0][0].shape[1]:
                    raise ValueError(f"row {r}: layers disagree on the prefix length")

    def _agreed(self, on_step: StepCallback | None) -> StepCallback | None:
        return agreed_step_callback(on_step, self.parallel.replica_rank, self.parallel.replica_world, self.device)

    @torch.no_grad()
    def denoise(
        self,
        prefix_rows: Sequence[PrefixRow],
        *,
        width: int,
        height: int,
        steps: int,
        guidance_scale: float,
        seed: int,
        on_step: StepCallback | None = None,
        abort: AbortCheck | None = None,
    ) -> torch.Tensor:
        """Latents ``[C, height/8, width/8]`` (model dtype, on the model's device) after ``steps``
        flow-matching Euler steps with CFG over ``prefix_rows`` (1 row when guidance_scale == 1).

        ``prefix_rows[r][layer] = (k, v)``, each ``[heads_local, T_r, head_dim]`` for this rank's
        head shard. ``on_step(k, steps)`` runs after each step on every rank; if it raises on any
        rank, every rank stops after that step (others raise ``DenoiseCancelled``). ``abort()``
        (CPU: checked before every block, see ``block_abort``; pass one on every rank or on none)
        returning True on any rank stops every rank at the same block of the running step: they
        raise ``StepAborted``.
        """
        self._check_prefix(prefix_rows, guidance_scale)
        self.last_abort = None
        if self.parallel.cfg.world_size > 1:
            return self._denoise_one_cfg_parallel(
                BatchRequest(prefix_rows, guidance_scale, seed), width, height, steps, on_step, abort
            )
        lat_h, lat_w = self.cfg.latent_size(width, height)
        rows = [self._on_device(row) for row in prefix_rows]
        noise = initial_noise(
            seed, (self.cfg.latent_channels, lat_h, lat_w), dtype=self.dtype, device=self.device
        )
        velocity = self.stepper(rows, lat_h, lat_w, self.block_abort(abort))
        done = 0

        def counted(step: int, total: int) -> None:
            nonlocal done
            done = step
            if on_step is not None:
                on_step(step, total)

        try:
            latents: torch.Tensor = euler_sample(
                velocity,
                noise,
                steps=steps,
                guidance_scale=guidance_scale,
                shift=self.timestep_shift,
                on_step=self._agreed(counted),
            )
        except StepAborted as err:
            self.last_abort = (done + 1, err.block, err.chunk)
            raise
        return latents

    @torch.no_grad()
    def denoise_batch(
        self,
        requests: Sequence[BatchRequest],
        *,
        width: int,
        height: int,
        steps: int,
        on_step: BatchStepCallback | None = None,
        abort: BatchAbortCheck | None = None,
    ) -> list[torch.Tensor | None]:
        """Several requests denoised together: every step is ONE forward over all their CFG rows
        stacked (each request's rows attend to its own prefixes), then each request's guidance and
        Euler update. Returns each request's latents ``[C, height/8, width/8]``, or None for a
        request stopped early.

        ``on_step(k, steps, active)`` runs after step k with the indices of the requests still
        running and returns those to stop now; the others go on (the batch shrinks at a step
        boundary). On ``world > 1`` ranks agree on the stopped set (one small all-reduce a step).
        ``abort(active)`` (CPU: checked before every block, see ``block_abort``; pass one on every
        rank or on none) returning True on any rank abandons the running step at that block on
        every rank: every active request stops there (``last_abort`` says where). It must say True
        only when every active request is to stop: a live request's rows never see a partial step.
        """
        self.last_abort = None
        if not requests:
            return []
        for req in requests:
            self._check_prefix(req.prefix_rows, req.guidance_scale)
        lat_h, lat_w = self.cfg.latent_size(width, height)
        rows_of = [[self._on_device(row) for row in req.prefix_rows] for req in requests]
        xs: list[torch.Tensor] = [
            initial_noise(req.seed, (self.cfg.latent_channels, lat_h, lat_w), dtype=self.dtype, device=self.device)
            for req in requests
        ]
        results: list[torch.Tensor | None] = [None] * len(requests)
        active = list(range(len(requests)))
        # Reads `active` when called: the batch's current requests.
        check = self.block_abort(None if abort is None else lambda: abort(list(active)))
        if self.parallel.cfg.world_size > 1:
            return self._denoise_batch_cfg_parallel(requests, rows_of, xs, lat_h, lat_w, steps, on_step, active, check)
        times = flow_timesteps(steps, self.timestep_shift)
        velocity = self.stepper([row for i in active for row in rows_of[i]], lat_h, lat_w, check)
        for k in range(steps):
            t, t_next = float(times[k]), float(times[k + 1])
            counts = [len(rows_of[i]) for i in active]
            batch = torch.cat([xs[i].unsqueeze(0).expand(n, *xs[i].shape) for i, n in zip(active, counts, strict=True)])
            try:
                v_all = velocity(batch, t)
            except StepAborted as err:
                self.last_abort = (k + 1, err.block, err.chunk)
                return results
            for i, v in zip(active, v_all.split(counts), strict=True):
                guided = combine_cfg(v, requests[i].guidance_scale)
                xs[i] = (xs[i].float() + (t_next - t) * guided.float()).to(self.dtype)
            stop = set(on_step(k + 1, steps, list(active))) if on_step is not None else set()
            stop = self._agreed_stop(stop, len(requests)) & set(active)
            if stop:
                active = [i for i in active if i not in stop]
                if not active:
                    return results
                if k + 1 < steps:
                    velocity = self.stepper([row for i in active for row in rows_of[i]], lat_h, lat_w, check)
        for i in active:
            results[i] = xs[i]
        return results

    def _denoise_batch_cfg_parallel(
        self,
        requests: Sequence[BatchRequest],
        rows_of: Sequence[Sequence[PrefixRow]],
        xs: list[torch.Tensor],
        lat_h: int,
        lat_w: int,
        steps: int,
        on_step: BatchStepCallback | None,
        active: list[int],
        check: AbortCheck | None,
    ) -> list[torch.Tensor | None]:
        """CFG-parallel batch: this rank's group computes its row of each request (``local_rows``:
        one row, or none of a one-row request on group 1) in ONE forward; one all-gather over the
        CFG group per step then gives every rank every row's velocity, in row order, and each rank
        applies the same guidance and Euler update, so every rank ends with the same latents.
        ``check`` (``block_abort``'s, agreed over the whole replica) runs before every block; a
        group with no rows this step runs the same checks (``DitModel.idle_blocks``). ``active``
        (every request at first) is updated in place as requests stop: ``check`` reads it."""
        cfg = self.parallel.cfg
        shape = (self.cfg.latent_channels, lat_h, lat_w)
        results: list[torch.Tensor | None] = [None] * len(requests)
        times = flow_timesteps(steps, self.timestep_shift)

        def build(active: list[int]) -> tuple[list[int], VelocityFn | None]:
            mine = [i for i in active if rows_of[i]]
            return mine, (self.stepper([rows_of[i][0] for i in mine], lat_h, lat_w, check) if mine else None)

        mine, velocity = build(active)
        for k in range(steps):
            t, t_next = float(times[k]), float(times[k + 1])
            local = torch.zeros(len(active), *shape, dtype=self.dtype, device=self.device)
            try:
                if velocity is not None:
                    batch = torch.stack([xs[i] for i in mine])
                    at = torch.tensor([active.index(i) for i in mine], device=self.device)
                    local.index_copy_(0, at, velocity(batch, t).to(self.dtype))
                elif check is not None:
                    self.model.idle_blocks(check, lat_h, lat_w)
            except StepAborted as err:
                self.last_abort = (k + 1, err.block, err.chunk)
                return results
            gathered = cfg.all_gather(local, dim=0).view(cfg.world_size, len(active), *shape)
            for j, i in enumerate(active):
                # Row r's velocity came from group cfg_group(r): rows 0..n-1 are groups 0..n-1.
                guided = combine_cfg(gathered[: cfg_rows(requests[i].guidance_scale), j], requests[i].guidance_scale)
                xs[i] = (xs[i].float() + (t_next - t) * guided.float()).to(self.dtype)
            stop = set(on_step(k + 1, steps, list(active))) if on_step is not None else set()
            stop = self._agreed_stop(stop, len(requests)) & set(active)
            if stop:
                active[:] = [i for i in active if i not in stop]
                if not active:
                    return results
                if k + 1 < steps:
                    mine, velocity = build(active)
        for i in active:
            results[i] = xs[i]
        return results

    def _denoise_one_cfg_parallel(
        self, request: BatchRequest, width: int, height: int, steps: int, on_step: StepCallback | None,
        abort: AbortCheck | None = None,
    ) -> torch.Tensor:
        """``denoise`` on a CFG-parallel replica: the batch path with one request, its step
        callback's stop turned into the same exceptions as ``denoise`` raises."""
        error: list[BaseException] = []

        def batch_step(step: int, total: int, active: list[int]) -> set[int]:
            if on_step is None:
                return set()
            try:
                on_step(step, total)
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the agreed stop
                error.append(err)
                return {0}
            return set()

        (latents,) = self.denoise_batch([request], width=width, height=height, steps=steps, on_step=batch_step,
                                        abort=None if abort is None else lambda active: abort())
        if latents is None:
            if error:
                raise error[0]
            if self.last_abort is not None:
                raise StepAborted(self.last_abort[1], self.cfg.num_layers, self.last_abort[2])
            raise DenoiseCancelled(f"another rank stopped denoising of {steps} steps")
        return latents

    def _agreed_stop(self, stop: set[int], n: int) -> set[int]:
        return agreed_stop_set(stop, n, self.parallel.replica_rank, self.parallel.replica_world, self.device)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """RGB uint8 ``[8h, 8w, 3]`` on CPU from latents ``[C, h, w]``."""
        image: torch.Tensor = self.decoder(latents)
        return image.cpu()

    def generate(
        self,
        prefix_rows: Sequence[PrefixRow],
        *,
        width: int,
        height: int,
        steps: int,
        guidance_scale: float,
        seed: int,
        on_step: StepCallback | None = None,
    ) -> torch.Tensor:
        """``decode(denoise(...))``: the image, uint8 ``[height, width, 3]`` on CPU, on every rank."""
        latents = self.denoise(
            prefix_rows,
            width=width,
            height=height,
            steps=steps,
            guidance_scale=guidance_scale,
            seed=seed,
            on_step=on_step,
        )
        return self.decode(latents)


def shard_prefix(full_row: Sequence[LayerKv], world: int, rank: int) -> list[LayerKv]:
    """Rank ``rank``'s head shard of a full prefix row (per layer ``[H_kv, T, D]``), as views: what
    ``read_prefix`` returns on that rank when the pages hold the same prefix."""
    out = []
    for k, v in full_row:
        per = k.shape[0] // world
        if per * world != k.shape[0]:
            raise ValueError(f"{k.shape[0]} kv heads do not split over {world} shards")
        out.append((k[rank * per : (rank + 1) * per], v[rank * per : (rank + 1) * per]))
    return out


def random_prefix(
    preset: ModelPreset,
    num_tokens: int,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
) -> list[LayerKv]:
    """A full (all kv heads) seeded prefix row ``[H_kv, T, D]`` per layer, for tests and benchmarks
    that run the DiT without an AR (values O(1), as RoPE'd keys and values are)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    shape = (preset.num_layers, 2, preset.num_kv_heads, num_tokens, preset.head_dim)
    kv = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return [(kv[layer, 0], kv[layer, 1]) for layer in range(preset.num_layers)]


def agreed_step_callback(
    on_step: StepCallback | None, rank: int, world: int, device: torch.device
) -> StepCallback | None:
    """Wrap the step callback so that all ranks stop after the same step (one tiny all-reduce
    per step); without it a rank that stops leaves the others blocked in a collective."""
    if world == 1:
        return on_step

    def agreed(step: int, total: int) -> None:
        error: BaseException | None = None
        if on_step is not None:
            try:
                on_step(step, total)
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the vote
                error = err
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
        # Through TpGroup over the whole replica: it stages through host memory when ranks
        # that share a GPU use gloo, which has no collectives on CUDA tensors there.
        TpGroup(rank, world, None).all_reduce(flag)
        if error is not None:
            raise error
        if int(flag.item()):
            raise DenoiseCancelled(f"another rank stopped denoising after step {step}/{total}")

    return agreed


def agreed_abort(abort: AbortCheck, rank: int, world: int) -> AbortCheck:
    """Wrap a rank's abort check so that every rank of the replica gets the same answer at the same
    call (one 4-byte all-reduce over the whole replica, CPU/gloo): True when ``abort()`` said True
    on any rank. Every rank must call it at the same points (``DitModel.step`` checks before every
    block, a rank without rows ``DitModel.idle_blocks``), or the all-reduces pair up wrongly and
    hang; a rank whose check raises still votes (to stop), then raises."""
    if world == 1:
        return abort

    def agreed() -> bool:
        error: BaseException | None = None
        try:
            mine = bool(abort())
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the vote
            error, mine = err, True
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        TpGroup(rank, world, None).all_reduce(flag)
        if error is not None:
            raise error
        return bool(flag.item())

    return agreed


def agreed_stop_set(stop: set[int], n: int, rank: int, world: int, device: torch.device) -> set[int]:
    """The union of every rank's stop set over `n` requests (a no-op in one process)."""
    if world == 1:
        return stop
    flags = torch.zeros(n, dtype=torch.int32, device=device)
    for i in stop:
        flags[i] = 1
    TpGroup(rank, world, None).all_reduce(flags)
    return {i for i, f in enumerate(flags.tolist()) if f}
