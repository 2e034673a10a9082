"""Transformer building blocks shared by the AR decoder and the DiT.

Owns RMSNorm, rotary position embeddings (rotate-half convention, as in Hugging Face Llama and
Qwen2, so their checkpoints load without permuting q/k), the SwiGLU MLP (tensor parallel), the
attention core (grouped-query, deterministic, optionally causal over a prefix) and the tensor
parallel attention projections. Tensors are heads-major (HND: [..., heads, tokens, head_dim]),
the layout that KV pages use, so K/V go to pages without a transpose.
Never owns processes, weights files or paging: see worker.py, loader.py, paged_attention.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvrelay.models.fp8 import free_source, linear, quantize_source_
from kvrelay.models.parallel import ColumnParallelLinear, RowParallelLinear, TpGroup

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype of a preset/geometry dtype name ("bfloat16" | "float16" | "float32")."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}") from None


def compile_enabled() -> bool:
    """Whether GPU models run their layers through torch.compile (``KVRELAY_COMPILE=0`` turns it off)."""
    return os.environ.get("KVRELAY_COMPILE", "1") != "0"


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` through torch.compile (inductor, shapes dynamic after the first change, so each new
    shape bucket does not compile again). The layers of a model share one compiled function: it
    takes the layer module as an argument, whose parameters become graph inputs."""
    import torch._dynamo

    # Blocks share the code but not the tensors; shape buckets and mask/no-mask add variants.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(int(getattr(torch._dynamo.config, name)), 64))
    out: Callable[..., Any] = torch.compile(fn, fullgraph=False)
    return out


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in fp32 whatever the activation dtype (bf16 would lose
    the small variances), result cast back, weight applied in the activation dtype (HF Llama)."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [T, head_dim] for integer `positions` [T].

    Angles are computed in fp32 (positions up to a few thousand times the base frequency lose
    precision in bf16) and only the tables are cast to `dtype`.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., heads, T, head_dim] by the tables [T, head_dim] of rope_cos_sin."""
    return x * cos + _rotate_half(x) * sin


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Scaled dot-product attention, grouped-query, heads-major.

    q: [..., Hq, Tq, D]; k, v: [..., Hkv, Tk, D] with Hq a multiple of Hkv (query head h reads kv
    head h // (Hq / Hkv), the Llama grouping). Returns [..., Hq, Tq, D].
    `causal` aligns the mask to the end: query i sees keys 0 .. i + (Tk - Tq), so queries that
    follow a prefix of Tk - Tq cached tokens see all of it (prefill with a prefix, chunked prefill).
    ``mask`` (bool ``[Tq, Tk]``, True = attend; causality included) replaces ``causal``: the
    block-diagonal causal mask of rows packed into one sequence.
    Deterministic: same inputs, same bits (one kernel choice per shape, no atomics on CPU).
    """
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    tq, tk = q.shape[-2], k.shape[-2]
    if hkv != hq:
        # Explicit expansion instead of SDPA's enable_gqa: one code path on every torch >= 2.11 build.
        k = k.repeat_interleave(hq // hkv, dim=-3)
        v = v.repeat_interleave(hq // hkv, dim=-3)
    if mask is not None:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if not causal:
        return nn.functional.scaled_dot_product_attention(q, k, v)
    if tq == tk:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if tq > tk:
        raise ValueError(f"causal attention with more queries ({tq}) than keys ({tk})")
    # SDPA's is_causal aligns to the top-left when Tq != Tk; we need bottom-right.
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def fuse_column_linears(linears: list[ColumnParallelLinear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One contiguous ``[sum(out), in]`` weight (and bias) holding the linears' weights in order;
    each linear's parameters become views into it, so one matmul computes all outputs and loading
    a checkpoint or seeded weights into the named parameters fills the fused buffer too. The
    linears are marked ``fused``: the owner of the fused weight runs and quantizes it, they never
    quantize themselves (``quantize_fp8_`` walks over them and gets 0)."""
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
        biases = [lin.bias for lin in linears]
        bias = torch.cat([b.detach() for b in biases if b is not None]) if all(
            b is not None for b in biases
        ) else None
        if bias is None and any(b is not None for b in biases):
            raise ValueError("fused linears must all have a bias or none")
        lo = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight.data = weight[lo : lo + rows]
            lin.fused = True
            if bias is not None and lin.bias is not None:
                lin.bias.data = bias[lo : lo + rows]
            lo += rows
    return weight, bias


def quantize_fused_(
    owner: nn.Module, name: str, buffer: str, pieces: list[ColumnParallelLinear], *, keep_source: bool
) -> None:
    """Quantize ``owner``'s fused weight ``name`` into its buffers ``<buffer>`` (e4m3) and
    ``<buffer>_scale``; unless ``keep_source``, free the fused weight and its pieces' views of
    it, each piece keeping its rows of the FP8 buffers (``fp8_rows``) for later loads. Per-row
    scales make a piece's rows of the fused quantization exactly its own quantization. A no-op
    once freed (loads since then went straight into the FP8 buffers)."""
    if not quantize_source_(owner, name, buffer, keep_source=keep_source) or keep_source:
        return
    q, scale = getattr(owner, buffer), getattr(owner, f"{buffer}_scale")
    lo = 0
    for piece in pieces:
        rows = piece.weight.shape[0]
        piece.fp8_rows = (q[lo : lo + rows], scale[:, lo : lo + rows])
        free_source(piece, "weight")
        lo += rows


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column parallel, down row parallel, so the
    intermediate activation never leaves the rank and one all-reduce ends the block."""

    _gate_up_fp8: torch.Tensor | None
    _gate_up_fp8_scale: torch.Tensor | None

    def __init__(
        self,
        hidden: int,
        mlp: int,
        tp: TpGroup,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, mlp, tp, dtype=dtype, device=device)
        self.up_proj = ColumnParallelLinear(hidden, mlp, tp, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(mlp, hidden, tp, dtype=dtype, device=device)
        # gate and up as one matmul ([gate | up] rows of one weight; the parameters are views).
        self._gate_up, _ = fuse_column_linears([self.gate_proj, self.up_proj])
        # FP8 copy of the fused weight (kvrelay.models.fp8), None unless quantized.
        self.register_buffer("_gate_up_fp8", None, persistent=False)
        self.register_buffer("_gate_up_fp8_scale", None, persistent=False)

    def quantize_fp8_(self, keep_source: bool = False) -> int:
        """Quantize the fused gate/up weight and free it unless ``keep_source`` (down_proj
        quantizes itself)."""
        quantize_fused_(self, "_gate_up", "_gate_up_fp8", [self.gate_proj, self.up_proj], keep_source=keep_source)
        return 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self._gate_up, None, self._gate_up_fp8, self._gate_up_fp8_scale).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(nn.functional.silu(gate) * up)
        return out


class ParallelAttention(nn.Module):
    """GQA projections split by heads over the TP group: rank r holds query heads
    [r*Hq/tp, (r+1)*Hq/tp) and kv heads [r*Hkv/tp, ...), which are exactly the kv heads its query
    heads read, so attention itself needs no communication; o_proj (row parallel) reduces.

    `forward` returns (output [B, T, hidden], k, v) with k after RoPE, k/v [B, Hkv_local, T, D],
    so callers can keep them as the KV cache. `prefix_kv` (k, v of earlier tokens,
    [B, Hkv_local, P, D]) is attended before the own tokens: `[prefix K/V | own K/V]`.
    `attn_mask` ([T, T] bool) replaces `causal` for rows packed into one sequence (see `attention`).
    """

    _qkv_fp8: torch.Tensor | None
    _qkv_fp8_scale: torch.Tensor | None

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        tp: TpGroup,
        *,
        qkv_bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        if num_kv_heads % tp.world_size:
            raise ValueError(
                f"tensor parallel size {tp.world_size} does not divide num_kv_heads={num_kv_heads}"
            )
        self.num_heads_local = num_heads // tp.world_size
        self.num_kv_heads_local = num_kv_heads // tp.world_size
        self.head_dim = head_dim
        self.q_proj = ColumnParallelLinear(
            hidden, num_heads * head_dim, tp, bias=qkv_bias, dtype=dtype, device=device
        )
        self.k_proj = ColumnParallelLinear(
            hidden, num_kv_heads * head_dim, tp, bias=qkv_bias, dtype=dtype, device=device
        )
        self.v_proj = ColumnParallelLinear(
            hidden, num_kv_heads * head_dim, tp, bias=qkv_bias, dtype=dtype, device=device
        )
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, tp, dtype=dtype, device=device)
        # q, k and v as one matmul (their parameters are views into the fused weight).
        self._qkv_weight, self._qkv_bias = fuse_column_linears([self.q_proj, self.k_proj, self.v_proj])
        self._qkv_split = (
            self.num_heads_local * head_dim,
            self.num_kv_heads_local * head_dim,
            self.num_kv_heads_local * head_dim,
        )
        # FP8 copy of the fused weight (kvrelay.models.fp8), None unless quantized.
        self.register_buffer("_qkv_fp8", None, persistent=False)
        self.register_buffer("_qkv_fp8_scale", None, persistent=False)

    def quantize_fp8_(self, keep_source: bool = False) -> int:
        """Quantize the fused q/k/v weight and free it unless ``keep_source`` (o_proj quantizes
        itself; the bias stays as is)."""
        quantize_fused_(
            self, "_qkv_weight", "_qkv_fp8", [self.q_proj, self.k_proj, self.v_proj], keep_source=keep_source
        )
        return 1

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, heads, T, D]`` (before RoPE) of ``x`` ``[B, T, hidden]``, from one matmul."""
        q, k, v = linear(x, self._qkv_weight, self._qkv_bias, self._qkv_fp8, self._qkv_fp8_scale).split(
            self._qkv_split, dim=-1
        )
        return (
            self._heads(q, self.num_heads_local),
            self._heads(k, self.num_kv_heads_local),
            self._heads(v, self.num_kv_heads_local),
        )

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        causal: bool,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if prefix_kv is not None:
            k_all = torch.cat((prefix_kv[0].to(k.dtype), k), dim=-2)
            v_all = torch.cat((prefix_kv[1].to(v.dtype), v), dim=-2)
        else:
            k_all, v_all = k, v
        out = attention(q, k_all, v_all, causal=causal, mask=attn_mask)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads_local * self.head_dim)
        return self.o_proj(out), k, v


def init_std(fan_in: int) -> float:
    """Std of random weights: 1/sqrt(fan_in) keeps activations O(1) through deep random stacks."""
    return 1.0 / math.sqrt(fan_in)
