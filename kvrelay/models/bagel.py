"""BAGEL-7B-MoT checkpoints: the key map, the understanding expert (AR) and the generation
expert (DiT), loaded tensor parallel from the published layout.

BAGEL (ByteDance-Seed/Bagel, `modeling/bagel/bagel.py`, `modeling/bagel/qwen2_navit.py`) is one
Qwen2 decoder with two sets of weights per layer (mixture of transformers): the understanding
expert (`q_proj`, `mlp`, `input_layernorm`, ... with QK-norm) encodes the prompt, the generation
expert (the `*_moe_gen` twins) denoises image latents. Disaggregated, the AR runs the prompt
through the understanding expert and keeps each layer's K (QK-normed, then RoPE'd at positions
0..T-1) and V: exactly BAGEL's KV cache after `forward_cache_update_text`. The DiT runs BAGEL's
`_forward_flow` over that cache: its query is `[<|vision_start|>, latent tokens, <|vision_end|>]`,
the two marker tokens through the understanding expert and the latent tokens through the
generation expert, all at one RoPE position (the prefix length; 2D position comes from the
fixed sin-cos `latent_pos_embed`), attending non-causally over `[prefix | query]`. Latent tokens
enter as `vae2llm(x_t) + time_embedder(t) + latent_pos_embed[pos]` and leave through
`norm_moe_gen` and `llm2vae` as the velocity.

Owns the module definitions (shared with the demo model, trained by scripts/train_demo.py), the
checkpoint layout (`ema.safetensors` or a sharded index, `llm_config.json`, `kvrelay.json`
overrides) and its strict loading: every tensor of the files is used by the AR or the DiT or is
on the short list of parts serving does not need (ViT, connector, LM head); a missing, unknown
or misshapen tensor raises CheckpointError naming it. Each TP rank reads only its slice.
Never owns sampling, VAE decoding or processes: kvrelay.models.bagel_runner and models/vae.py do.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.models.bagel_config import (
    BOS_TOKEN,
    EMA_FILE,
    END_OF_IMAGE,
    EOS_TOKEN,
    KVRELAY_CONFIG_FILE,
    LLM,
    LLM_CONFIG_FILE,
    START_OF_IMAGE,
    BagelConfig,
    load_bagel_config,
    stored_tensors,
)
from kvrelay.models.checkpoint import (
    CheckpointError,
    StoredTensor,
    check_float,
    check_shapes,
    missing_hint,
)
from kvrelay.models.fp8 import quantize_fp8_
from kvrelay.models.layers import RMSNorm, SwiGLU, apply_rotary, attention, rope_cos_sin
from kvrelay.models.loader import COLUMN, ROW, open_safetensors
from kvrelay.models.paged_attention import LayerKv, prefix_attention
from kvrelay.models.parallel import ColumnParallelLinear, RowParallelLinear, TpGroup
from kvrelay.models.presets import ArConfig
from kvrelay.models.stage import stage_preset as stage_preset  # here before; torch-free there
from kvrelay.models.ulysses import heads_to_seq, seq_to_heads

# Tensors of the published checkpoint that text-to-image serving does not use.
UNUSED_PREFIXES = ("vit_model.", "connector.", "vit_pos_embed.", "language_model.lm_head.")
TIMESTEP_FREQ_DIM = 256
GEN = "_moe_gen"


# ---------------------------------------------------------------------------------------------
# Modules (parameter names = checkpoint names without the `language_model.model.` prefix)
# ---------------------------------------------------------------------------------------------


def sincos_2d_table(side: int, dim: int) -> torch.Tensor:
    """BAGEL's latent_pos_embed table [side*side, dim] (MAE 2D sin-cos; fixed, never trained):
    the first half of the channels encodes the column, the second half the row."""
    if dim % 4:
        raise ValueError(f"hidden={dim} must be a multiple of 4 for the 2D sin-cos table")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = torch.arange(side, dtype=torch.float64)

    def one_axis(pos: torch.Tensor) -> torch.Tensor:
        angles = pos.reshape(-1)[:, None] * omega[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    cols = coords[None, :].expand(side, side)  # grid[0] in MAE's meshgrid(w, h): the column
    rows = coords[:, None].expand(side, side)
    return torch.cat([one_axis(cols), one_axis(rows)], dim=1).float()


def timestep_features(t: torch.Tensor, dim: int = TIMESTEP_FREQ_DIM) -> torch.Tensor:
    """DiT's sinusoidal timestep features [rows, dim] of flow times t in [0, 1] (BAGEL feeds t
    itself, not t x 1000), fp32: cos first, then sin."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MotAttention(nn.Module):
    """One layer's attention projections: the understanding expert, and with `gen` its
    generation twin. TP splits heads (q/k/v column parallel with biases, o row parallel)."""

    def __init__(self, cfg: ArConfig, tp: TpGroup, *, gen: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, nq, nkv, d = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if nkv % tp.world_size:
            raise ValueError(f"tensor parallel size {tp.world_size} does not divide num_kv_heads={nkv}")
        self.heads_local, self.kv_heads_local, self.head_dim = nq // tp.world_size, nkv // tp.world_size, d

        def col(out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(h, out, tp, bias=True, dtype=dtype, device=device)

        def norm() -> RMSNorm:
            return RMSNorm(d, cfg.norm_eps, dtype=dtype, device=device)

        self.q_proj, self.k_proj, self.v_proj = col(nq * d), col(nkv * d), col(nkv * d)
        self.o_proj = RowParallelLinear(nq * d, h, tp, dtype=dtype, device=device)
        self.q_norm, self.k_norm = norm(), norm()
        self.gen = gen
        if gen:
            self.q_proj_moe_gen, self.k_proj_moe_gen, self.v_proj_moe_gen = col(nq * d), col(nkv * d), col(nkv * d)
            self.o_proj_moe_gen = RowParallelLinear(nq * d, h, tp, dtype=dtype, device=device)
            self.q_norm_moe_gen, self.k_norm_moe_gen = norm(), norm()

    def qkv(
        self, x: torch.Tensor, *, gen: bool, fp32_norm: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Heads-major q, k (QK-normed, before RoPE) and v of x [B, T, hidden] through one expert.
        `fp32_norm`: normalize q/k in fp32 (BAGEL's gen mode, for every query token)."""
        s = GEN if gen else ""
        b, t, _ = x.shape
        q = getattr(self, "q_proj" + s)(x).view(b, t, self.heads_local, self.head_dim).transpose(1, 2)
        k = getattr(self, "k_proj" + s)(x).view(b, t, self.kv_heads_local, self.head_dim).transpose(1, 2)
        v = getattr(self, "v_proj" + s)(x).view(b, t, self.kv_heads_local, self.head_dim).transpose(1, 2)
        if fp32_norm:
            # BAGEL's gen mode normalizes q/k in fp32 and applies RoPE there.
            q, k = q.float(), k.float()
        return getattr(self, "q_norm" + s)(q), getattr(self, "k_norm" + s)(k), v

    def out(self, attn: torch.Tensor, *, gen: bool) -> torch.Tensor:
        proj: torch.Tensor = getattr(self, "o_proj" + (GEN if gen else ""))(attn)
        return proj


class MotLayer(nn.Module):
    def __init__(self, cfg: ArConfig, tp: TpGroup, *, gen: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
        self.self_attn = MotAttention(cfg, tp, gen=gen, dtype=dtype, device=device)
        self.mlp = SwiGLU(cfg.hidden, cfg.mlp, tp, dtype=dtype, device=device)
        if gen:
            self.input_layernorm_moe_gen = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
            self.post_attention_layernorm_moe_gen = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
            self.mlp_moe_gen = SwiGLU(cfg.hidden, cfg.mlp, tp, dtype=dtype, device=device)

    def part(self, name: str, gen: bool) -> Any:
        return getattr(self, name + (GEN if gen else ""))


class BagelAr(nn.Module):
    """The understanding expert: prompt -> every layer's K (QK-norm, RoPE at 0..T-1) and V.

    Same contract as the built-in ArModel (`prefill`, `config`, `dtype`, `device`), so the AR
    service runs it unchanged. Tensor parallel over kv heads.
    """

    def __init__(self, cfg: BagelConfig, tp: TpGroup | None = None, *, dtype: torch.dtype, device: str | torch.device):
        super().__init__()
        self.bagel = cfg
        self.config = cfg.llm
        self.tp = tp or TpGroup.single()
        self.dtype = dtype
        self.device = torch.device(device)
        llm = cfg.llm
        if llm.num_kv_heads % self.tp.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.tp.world_size} does not divide num_kv_heads={llm.num_kv_heads}"
            )
        self.num_kv_heads_local = llm.num_kv_heads // self.tp.world_size
        self.embed_tokens = nn.Embedding(llm.vocab, llm.hidden, dtype=dtype, device=self.device)
        self.layers = nn.ModuleList(
            MotLayer(llm, self.tp, gen=False, dtype=dtype, device=self.device) for _ in range(llm.num_layers)
        )
        for p in self.parameters():
            p.requires_grad_(False)

    def prefix_kv(self, ids: torch.Tensor) -> list[LayerKv]:
        """Differentiable K/V of a batch of prompts ids [B, T] (right padding allowed: causal
        attention keeps padding out of every real token), per layer ([B, Hkv, T, D] each)."""
        llm = self.config
        b, t = ids.shape
        cos, sin = rope_cos_sin(torch.arange(t, device=ids.device), llm.head_dim, llm.rope_theta, dtype=self.dtype)
        x = self.embed_tokens(ids)
        out: list[LayerKv] = []
        last = len(self.layers) - 1
        for i, module in enumerate(self.layers):
            layer: MotLayer = module  # type: ignore[assignment]
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), gen=False)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out.append((k, v))
            if i == last:
                break  # nothing after the last attention changes any K/V
            o = attention(q, k, v, causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + attn.out(o, gen=False)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return out

    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """[num_layers, 2, num_kv_heads_local, T, head_dim] in the model dtype (ArModel's contract)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        n = ids.numel()
        if n > self.config.max_tokens:
            raise ValueError(f"prompt has {n} tokens; the model's max is {self.config.max_tokens}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab:
            raise ValueError(f"token ids must be in [0, {self.config.vocab}), got [{lo}, {hi}]")
        kv = self.prefix_kv(ids.to(self.device)[None])
        return torch.stack([torch.stack((k[0], v[0])) for k, v in kv]).to(self.dtype)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQ_DIM, hidden, dtype=dtype, device=device),
            nn.SiLU(),
            nn.Linear(hidden, hidden, dtype=dtype, device=device),
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        first: nn.Linear = self.mlp[0]  # type: ignore[assignment]
        out: torch.Tensor = self.mlp(timestep_features(t).to(first.weight.dtype))
        return out


class PositionEmbedding(nn.Module):
    def __init__(self, side: int, hidden: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.pos_embed = nn.Parameter(sincos_2d_table(side, hidden).to(device=device, dtype=dtype), requires_grad=False)


class BagelDit(nn.Module):
    """BAGEL's `_forward_flow`: velocity of latent tokens given each row's AR prefix.

    `forward(x [R, n, patch_dim], t [R], pos_ids [n], prefixes, prefix_lens)`:
    `prefixes[r][layer] = (k, v)` of this rank's kv heads ([Hkv_local, T_r, D]); with `sp` > 1
    this rank computes its share of the query tokens (Ulysses). Training passes a padded batch
    (`padded_prefix`: per layer (k, v) [R, Hkv, T, D] plus `prefix_lens`) instead.
    """

    def __init__(
        self,
        cfg: BagelConfig,
        tp: TpGroup | None = None,
        sp: TpGroup | None = None,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
    ):
        super().__init__()
        self.bagel = cfg
        llm = cfg.llm
        self.tp, self.sp = tp or TpGroup.single(), sp or TpGroup.single()
        self.dtype, self.device = dtype, torch.device(device)
        dev = self.device
        if llm.num_kv_heads % (self.tp.world_size * self.sp.world_size):
            raise ValueError(
                f"num_kv_heads={llm.num_kv_heads} does not split over tp={self.tp.world_size} x sp={self.sp.world_size}"
            )
        # Only the two marker rows of embed_tokens are needed: (<|vision_start|>, <|vision_end|>).
        self.marker_embed = nn.Parameter(torch.zeros(2, llm.hidden, dtype=dtype, device=dev), requires_grad=False)
        self.layers = nn.ModuleList(
            MotLayer(llm, self.tp, gen=True, dtype=dtype, device=dev) for _ in range(llm.num_layers)
        )
        self.norm = RMSNorm(llm.hidden, llm.norm_eps, dtype=dtype, device=dev)
        self.norm_moe_gen = RMSNorm(llm.hidden, llm.norm_eps, dtype=dtype, device=dev)
        self.time_embedder = TimestepEmbedder(llm.hidden, dtype=dtype, device=dev)
        self.vae2llm = nn.Linear(cfg.patch_dim, llm.hidden, dtype=dtype, device=dev)
        self.llm2vae = nn.Linear(llm.hidden, cfg.patch_dim, dtype=dtype, device=dev)
        self.latent_pos_embed = PositionEmbedding(cfg.max_latent_size, llm.hidden, dtype=dtype, device=dev)
        for p in self.parameters():
            p.requires_grad_(False)

    def quantize_generation_fp8_(self, keep_source: bool = False) -> int:
        """Quantize the generation expert's big linears to FP8 (kvrelay.models.fp8), in place,
        freeing their bf16 weights unless ``keep_source``; returns how many weight matrices were
        quantized: 6 per layer (q, k, v, o and the MLP's fused gate/up and down).

        Only the generation expert: it runs over every latent token, while the understanding
        expert (whose weights the DiT holds too) runs over the two image markers only, where FP8
        would save no time and its copies would cost memory. Norms, the timestep and latent
        embeddings and the vae2llm/llm2vae projections stay in the model dtype."""
        count = 0
        for module in self.layers:
            layer: MotLayer = module  # type: ignore[assignment]
            attn = layer.self_attn
            for proj in (attn.q_proj_moe_gen, attn.k_proj_moe_gen, attn.v_proj_moe_gen, attn.o_proj_moe_gen):
                count += proj.quantize_fp8_(keep_source=keep_source)
            count += quantize_fp8_(layer.mlp_moe_gen, keep_source=keep_source)  # the fused gate/up, then down_proj
        return count

    def position_ids(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """BAGEL's extrapolated latent position ids: row * max_latent_size + col, raster order."""
        side = self.bagel.max_latent_size
        rows = torch.arange(grid_h, device=self.device)[:, None] * side
        return (rows + torch.arange(grid_w, device=self.device)[None, :]).flatten()

    def _mix(self, x: torch.Tensor, und: torch.Tensor, gen_fn: Any, und_fn: Any) -> torch.Tensor:
        """gen_fn over every token, und_fn over the marker tokens (indices `und`), merged."""
        out: torch.Tensor = gen_fn(x)
        if und.numel():
            out = out.index_copy(1, und, und_fn(x.index_select(1, und)).to(out.dtype))
        return out

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        pos_ids: torch.Tensor,
        prefixes: Sequence[Sequence[LayerKv]] | None,
        prefix_lens: Sequence[int] | torch.Tensor,
        *,
        padded_prefix: Sequence[LayerKv] | None = None,
    ) -> torch.Tensor:
        llm, sp = self.bagel.llm, self.sp
        rows, n, _ = x_t.shape
        # The query: [<|vision_start|>, n latent tokens, <|vision_end|>], padded to split over SP.
        total = n + 2
        padded = -(-total // sp.world_size) * sp.world_size
        n_local = padded // sp.world_size
        lo = sp.rank * n_local
        lat = self.vae2llm(x_t.to(self.dtype)) + self.time_embedder(t)[:, None, :]
        lat = lat + self.latent_pos_embed.pos_embed[pos_ids].to(self.dtype)[None]
        start = self.marker_embed[0].expand(rows, 1, -1)
        end = self.marker_embed[1].expand(rows, 1, -1)
        seq = torch.cat([start.to(lat.dtype), lat, end.to(lat.dtype)], dim=1)
        if padded != total:
            seq = F.pad(seq, (0, 0, 0, padded - total))
        h = seq[:, lo : lo + n_local]
        und_global = torch.tensor([0, total - 1], device=self.device)
        und = und_global[(und_global >= lo) & (und_global < lo + n_local)] - lo

        lens = torch.as_tensor(prefix_lens, device=self.device)
        # Every query token of row r sits at RoPE position T_r (BAGEL: one position per image).
        cos, sin = rope_cos_sin(lens, llm.head_dim, llm.rope_theta, dtype=torch.float32)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # [R, 1, 1, D]
        key_mask = None
        if padded_prefix is not None:
            t_max = padded_prefix[0][0].shape[2]
            valid = torch.arange(t_max, device=self.device)[None, :] < lens[:, None]
            key_mask = torch.cat([valid, torch.ones(rows, padded, dtype=torch.bool, device=self.device)], dim=1)
            if padded != total:
                key_mask[:, t_max + total :] = False
            key_mask = key_mask[:, None, None, :]

        for i, module in enumerate(self.layers):
            layer: MotLayer = module  # type: ignore[assignment]
            attn = layer.self_attn
            normed = self._mix(h, und, layer.input_layernorm_moe_gen, layer.input_layernorm)
            q, k, v = self._qkv(attn, normed, und)
            q = apply_rotary(q, cos, sin).to(self.dtype)
            k = apply_rotary(k, cos, sin).to(self.dtype)
            q, k, v = seq_to_heads(q, sp), seq_to_heads(k, sp), seq_to_heads(v, sp)
            if padded_prefix is not None:
                pk, pv = padded_prefix[i]
                keys = torch.cat([pk.to(k.dtype), k], dim=2)
                values = torch.cat([pv.to(v.dtype), v], dim=2)
                group = q.shape[1] // keys.shape[1]
                if group > 1:
                    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask)
            else:
                assert prefixes is not None
                o = prefix_attention(q, k, v, [p[i] for p in prefixes], num_valid=total)
            o = heads_to_seq(o, sp).transpose(1, 2).reshape(rows, n_local, -1)
            h = h + self._mix(o, und, attn.o_proj_moe_gen, attn.o_proj)
            normed = self._mix(h, und, layer.post_attention_layernorm_moe_gen, layer.post_attention_layernorm)
            h = h + self._mix(normed, und, layer.mlp_moe_gen, layer.mlp)
        h = self._mix(h, und, self.norm_moe_gen, self.norm)
        v_local = self.llm2vae(h)
        v_all = sp.all_gather(v_local, dim=1)
        return v_all[:, 1 : n + 1]

    def _qkv(self, attn: MotAttention, x: torch.Tensor, und: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = attn.qkv(x, gen=True, fp32_norm=True)
        if und.numel():
            uq, uk, uv = attn.qkv(x.index_select(1, und), gen=False, fp32_norm=True)
            q = q.index_copy(2, und, uq.to(q.dtype))
            k = k.index_copy(2, und, uk.to(k.dtype))
            v = v.index_copy(2, und, uv.to(v.dtype))
        return q, k, v


# ---------------------------------------------------------------------------------------------
# Key map and strict loading
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tensor:
    """One checkpoint tensor: its file name, the module parameter it fills, its split dim."""

    file_key: str
    model_key: str
    shard_dim: int | None = None


def _layer_specs(i: int, gen: bool) -> Iterator[Tensor]:
    ours, theirs = f"layers.{i}.", f"{LLM}layers.{i}."
    suffixes = ("", GEN) if gen else ("",)
    for s in suffixes:
        for name, dim in (
            (f"input_layernorm{s}.weight", None),
            (f"post_attention_layernorm{s}.weight", None),
            (f"self_attn.q_proj{s}.weight", COLUMN),
            (f"self_attn.q_proj{s}.bias", COLUMN),
            (f"self_attn.k_proj{s}.weight", COLUMN),
            (f"self_attn.k_proj{s}.bias", COLUMN),
            (f"self_attn.v_proj{s}.weight", COLUMN),
            (f"self_attn.v_proj{s}.bias", COLUMN),
            (f"self_attn.o_proj{s}.weight", ROW),
            (f"self_attn.q_norm{s}.weight", None),
            (f"self_attn.k_norm{s}.weight", None),
            (f"mlp{s}.gate_proj.weight", COLUMN),
            (f"mlp{s}.up_proj.weight", COLUMN),
            (f"mlp{s}.down_proj.weight", ROW),
        ):
            # The MLP twin is `mlp_moe_gen.gate_proj`, the others put the suffix on the leaf.
            yield Tensor(theirs + name, ours + name, dim)


def ar_tensors(cfg: BagelConfig) -> tuple[Tensor, ...]:
    """The AR's tensors: embeddings and the understanding expert of every layer."""
    specs = [Tensor(f"{LLM}embed_tokens.weight", "embed_tokens.weight")]
    for i in range(cfg.llm.num_layers):
        specs += _layer_specs(i, gen=False)
    return tuple(specs)


def dit_tensors(cfg: BagelConfig) -> tuple[Tensor, ...]:
    """The DiT's tensors: both experts of every layer (the image markers go through the
    understanding expert), both final norms, the timestep/latent embeddings and projections.
    (The two marker rows of embed_tokens are read separately.)"""
    specs: list[Tensor] = []
    for i in range(cfg.llm.num_layers):
        specs += _layer_specs(i, gen=True)
    specs += [
        Tensor(f"{LLM}norm.weight", "norm.weight"),
        Tensor(f"{LLM}norm_moe_gen.weight", "norm_moe_gen.weight"),
        Tensor("time_embedder.mlp.0.weight", "time_embedder.mlp.0.weight"),
        Tensor("time_embedder.mlp.0.bias", "time_embedder.mlp.0.bias"),
        Tensor("time_embedder.mlp.2.weight", "time_embedder.mlp.2.weight"),
        Tensor("time_embedder.mlp.2.bias", "time_embedder.mlp.2.bias"),
        Tensor("vae2llm.weight", "vae2llm.weight"),
        Tensor("vae2llm.bias", "vae2llm.bias"),
        Tensor("llm2vae.weight", "llm2vae.weight"),
        Tensor("llm2vae.bias", "llm2vae.bias"),
    ]
    return tuple(specs)


# latent_pos_embed.pos_embed is a fixed sin-cos table that BAGEL's constructor computes; a file
# without it (some exports drop frozen parameters) gets the identical computed table.
OPTIONAL = {"latent_pos_embed.pos_embed": "latent_pos_embed.pos_embed"}


def check_keys(cfg: BagelConfig, shapes: dict[str, StoredTensor]) -> dict[str, StoredTensor]:
    """Every tensor name of the files, checked: the AR's and DiT's must all be present; any other
    tensor must be on the unused list. Raises CheckpointError naming the first offender."""
    known = {s.file_key for s in ar_tensors(cfg)} | {s.file_key for s in dit_tensors(cfg)} | set(OPTIONAL)
    for key in sorted(known - set(OPTIONAL)):
        if key not in shapes:
            raise CheckpointError(f"BAGEL checkpoint is missing tensor {key!r}{missing_hint(key, shapes)}")
    for key in sorted(shapes):
        if key not in known and not key.startswith(UNUSED_PREFIXES):
            raise CheckpointError(f"BAGEL checkpoint has an unexpected tensor {key!r} ({shapes[key].path.name})")
    return shapes


def check_file_shapes(module: nn.Module, specs: Sequence[Tensor], shapes: dict[str, StoredTensor], tp: TpGroup) -> None:
    """Every spec's stored shape is the module's full shape (a `meta` module: nothing allocated)."""
    params = dict(module.named_parameters())
    want = {}
    for spec in specs:
        full = list(params[spec.model_key].shape)
        if spec.shard_dim is not None:
            full[spec.shard_dim] *= tp.world_size
        want[spec.file_key] = tuple(full)
    check_shapes(shapes, want, LLM_CONFIG_FILE)


def precheck(directory: str | Path, cfg: BagelConfig, *, dit: bool, tp: TpGroup | None = None) -> None:
    """Names, shapes and dtypes of the files against a `meta` copy of the AR (or DiT): refused
    before the real model is allocated."""
    shapes = check_keys(cfg, stored_tensors(directory))
    if dit:
        check_file_shapes(BagelDit(cfg, tp, dtype=torch.float32, device="meta"), dit_tensors(cfg), shapes, tp or TpGroup.single())
    else:
        check_file_shapes(BagelAr(cfg, tp, dtype=torch.float32, device="meta"), ar_tensors(cfg), shapes, tp or TpGroup.single())


@torch.no_grad()
def _load(
    module: nn.Module,
    specs: Sequence[Tensor],
    shapes: dict[str, StoredTensor],
    tp: TpGroup,
    world_shards: int = 1,
) -> None:
    params = dict(module.named_parameters())
    freed = [spec.model_key for spec in specs if params[spec.model_key].is_meta]
    if freed:  # copying into a meta tensor would silently do nothing
        raise ValueError(f"{freed[0]} was freed by FP8 quantization: load into a new runner")
    handles: dict[Path, Any] = {}
    try:
        for spec in specs:
            param = params[spec.model_key]
            want = list(param.shape)
            if spec.shard_dim is not None:
                want[spec.shard_dim] *= tp.world_size
            stored = shapes[spec.file_key]
            shape, path = stored.shape, stored.path
            if tuple(want) != shape:
                raise CheckpointError(f"{spec.file_key}: shape {shape} in {path.name}, the model expects {tuple(want)}")
            check_float(spec.file_key, stored)
            if path not in handles:
                handles[path] = open_safetensors(path).__enter__()
            piece = handles[path].get_slice(spec.file_key)
            if spec.shard_dim is None or tp.world_size == 1:
                tensor = piece[:]
            else:
                lo, hi = tp.shard_range(shape[spec.shard_dim])
                index = tuple(slice(lo, hi) if d == spec.shard_dim else slice(None) for d in range(len(shape)))
                tensor = piece[index]
            param.copy_(tensor.to(param.dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def load_ar(directory: str | Path, cfg: BagelConfig, model: BagelAr) -> BagelAr:
    """Fill `model` (this rank's shards) from the directory's weights, strictly."""
    shapes = check_keys(cfg, stored_tensors(directory))
    _load(model, ar_tensors(cfg), shapes, model.tp)
    return model


def load_dit(directory: str | Path, cfg: BagelConfig, model: BagelDit) -> BagelDit:
    shapes = check_keys(cfg, stored_tensors(directory))
    _load(model, dit_tensors(cfg), shapes, model.tp)
    embed_key = f"{LLM}embed_tokens.weight"
    embed = shapes[embed_key]
    shape, path = embed.shape, embed.path
    if len(shape) != 2 or shape[1] != cfg.llm.hidden or max(cfg.start_of_image, cfg.end_of_image) >= shape[0]:
        raise CheckpointError(f"{embed_key}: shape {shape} has no rows for the image marker tokens")
    check_float(embed_key, embed)
    with torch.no_grad(), open_safetensors(path) as f:
        piece = f.get_slice(embed_key)
        rows = [piece[i : i + 1] for i in (cfg.start_of_image, cfg.end_of_image)]
        model.marker_embed.copy_(torch.cat(rows).to(model.marker_embed.dtype))
        if "latent_pos_embed.pos_embed" in shapes:
            pos = shapes["latent_pos_embed.pos_embed"]
            want = tuple(model.latent_pos_embed.pos_embed.shape)
            if pos.shape != want:
                raise CheckpointError(f"latent_pos_embed.pos_embed: shape {pos.shape}, the model expects {want}")
            check_float("latent_pos_embed.pos_embed", pos)
            with open_safetensors(pos.path) as g:
                model.latent_pos_embed.pos_embed.copy_(g.get_tensor("latent_pos_embed.pos_embed").to(model.dtype))
    return model


def build_ar(
    directory: str | Path,
    *,
    tp: TpGroup | None = None,
    device: str = "cpu",
    dtype: str | None = None,
) -> BagelAr:
    from kvrelay.models.layers import torch_dtype

    cfg = load_bagel_config(directory)
    precheck(directory, cfg, dit=False, tp=tp)
    # The checkpoint's dtype (kvrelay.json, else bfloat16) unless the stage overrides it: the DiT
    # uses the same rule, so both sides agree on the KV geometry.
    model = BagelAr(cfg, tp, dtype=torch_dtype(dtype or cfg.dtype), device=device).eval()
    return load_ar(directory, cfg, model)


# ---------------------------------------------------------------------------------------------
# Writing (tests, the demo trainer): the published names and layout
# ---------------------------------------------------------------------------------------------


def state_for_file(ar: BagelAr | None, dit: BagelDit) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (published names) of an unsharded AR + DiT pair. The AR's
    understanding weights are the DiT's too (one model): the DiT's copy is written, the AR's
    embeddings fill `embed_tokens` (whose marker rows must equal the DiT's marker_embed)."""
    if dit.tp.world_size != 1 or dit.sp.world_size != 1:
        raise ValueError("writing needs the unsharded model")
    cfg = dit.bagel
    params = dict(dit.named_parameters())
    if any(p.is_meta for p in params.values()):
        raise ValueError("writing needs the unquantized model: FP8 quantization freed the generation expert's weights")
    out = {s.file_key: params[s.model_key].detach().cpu().contiguous() for s in dit_tensors(cfg)}
    out["latent_pos_embed.pos_embed"] = dit.latent_pos_embed.pos_embed.detach().cpu().contiguous()
    if ar is not None:
        embed = ar.embed_tokens.weight.detach().cpu().clone()
    else:
        embed = torch.zeros(cfg.llm.vocab, cfg.llm.hidden, dtype=dit.dtype)
    embed[cfg.start_of_image] = dit.marker_embed[0].detach().cpu()
    embed[cfg.end_of_image] = dit.marker_embed[1].detach().cpu()
    out[f"{LLM}embed_tokens.weight"] = embed.contiguous()
    return out


def llm_config_json(cfg: ArConfig) -> dict[str, Any]:
    """A Qwen2 `llm_config.json` in the release's shape."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_tokens,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "qk_norm": True,
        "layer_module": "Qwen2MoTDecoderLayer",
    }


def init_random(module: nn.Module, seed: int) -> None:
    """Seeded weights for tests: linears ~ N(0, 1/fan_in), norms near 1, biases small; the
    position table stays the sin-cos table."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.endswith("pos_embed"):
                continue
            full = torch.randn(p.shape, generator=gen)
            if "norm" in name and p.dim() == 1:
                full = 1.0 + 0.1 * full
            elif name.endswith(".bias"):
                full = 0.02 * full
            elif p.dim() == 2 and not name.endswith("embed_tokens.weight") and name != "marker_embed":
                full = full / math.sqrt(p.shape[1])
            p.copy_(full.to(p.dtype))


def word_tokenizer_json(words: Sequence[str]) -> str:
    """A word-level `tokenizer.json` (lower-cased, split on whitespace and punctuation) whose
    added tokens are BAGEL's four specials: the demo model's tokenizer, and the tests'. Ids:
    <unk> 0, the words, then the specials."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {"<unk>": 0}
    for w in words:
        vocab.setdefault(w.lower(), len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([BOS_TOKEN, EOS_TOKEN, START_OF_IMAGE, END_OF_IMAGE])
    out: str = tok.to_str()
    return out


def write_bagel_dir(
    directory: str | Path,
    ar: BagelAr,
    dit: BagelDit,
    *,
    tokenizer_json: str,
    kvrelay: dict[str, Any] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write an AR + DiT pair in the release's layout: `ema.safetensors` (published names),
    `llm_config.json`, `tokenizer.json` and, when given, `kvrelay.json`."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = state_for_file(ar, dit)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(d / EMA_FILE), metadata={"format": "pt"})
    (d / LLM_CONFIG_FILE).write_text(json.dumps(llm_config_json(dit.bagel.llm), indent=2, sort_keys=True) + "\n")
    (d / "tokenizer.json").write_text(tokenizer_json)
    if kvrelay is not None:
        (d / KVRELAY_CONFIG_FILE).write_text(json.dumps(kvrelay, indent=2, sort_keys=True) + "\n")
    return d
