"""FP8 (e4m3) weights and activations for the transformer's big linears: opt-in quantization.

The scheme is the one vLLM calls dynamic FP8 with per-channel weights: each weight row (one output
feature) gets its own fp32 scale, computed once when the weights are quantized (``amax / 448``);
each activation row (one token) gets its own scale, computed on the fly inside the step; the
product runs as one ``torch._scaled_mm`` (an FP8 tensor-core GEMM on Hopper/Ada GPUs, a reference
kernel on the CPU) that applies both scales and returns the activation dtype. Per-token and
per-channel scales keep outlier tokens and channels from costing everyone else their precision.

Owns only the arithmetic (``quantize_rows``, ``fp8_linear``), the support check and the walk that
quantizes a module tree (``quantize_fp8_``). Which layers take part is each layer's own business:
a module that can run its matmul in FP8 has a ``quantize_fp8_()`` method (the fused qkv and
gate/up projections, the row-parallel o/down projections, column-parallel linears that are not
pieces of a fused weight); everything else (norms, adaLN
modulation, embeddings, the final projection, attention itself) stays in the model dtype. The
FP8 copies live in non-persistent buffers; once a layer is quantized its source weight is freed
(``free_source``: the parameter becomes a meta tensor of the same shape and dtype, holding no
memory), so FP8 saves memory instead of adding a copy. Weights loaded later (a checkpoint, seeded
weights) go straight into the FP8 buffers, in place (``quantize_into``), one matrix at a time.
``quantize_fp8_(module, keep_source=True)`` keeps the sources (tests compare against it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# Smallest amax a row may have: an all-zero row (padding tokens) would otherwise divide by zero.
_MIN_AMAX = 1e-12
QUANTIZATIONS = ("fp8",)


def fp8_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FP8 linears cannot run on ``device`` with activations of ``dtype``; None if they can."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8_e4m3fn/_scaled_mm"
    if dtype == torch.float16:
        return "fp8 GEMMs here return bfloat16 (GPU) or bfloat16/float32 (CPU), not float16: use dtype bfloat16"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            return f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores: needs 8.9 or newer (Ada, Hopper)"
        if dtype != torch.bfloat16:
            return f"on GPUs fp8 linears need bfloat16 activations, not {dtype}"
    elif device.type != "cpu":
        return f"no fp8 GEMM on {device.type} devices"
    return None


def check_quantization(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError, saying why, unless ``quantization`` (None or one of QUANTIZATIONS) can run
    on ``device`` with activations of ``dtype``: what every runner checks before loading weights."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    reason = fp8_unsupported(device, dtype)
    if reason is not None:
        raise ValueError(f"quantization {quantization}: {reason}")


@torch.no_grad()
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` as e4m3 ``[N, K]`` (contiguous) and its per-row fp32 scales ``[1, N]``,
    so that ``q[n].float() * scale[0, n]`` approximates ``weight[n]``."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 quantization takes [out, in] weights, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if weight.device.type == "cuda" and (n % 16 or k % 16):
        raise ValueError(f"fp8 GEMMs on GPUs need both weight dims divisible by 16, got [{n}, {k}]")
    w32 = weight.float()
    scale = w32.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX  # [N, 1]
    q = (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()
    return q, scale.reshape(1, n).contiguous()


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with W given by ``quantize_rows`` and x quantized per row (token) here.

    x: ``[..., K]`` in the model dtype; returns ``[..., N]`` in x's dtype. Deterministic: the
    scales come from a max, the GEMM is one cuBLAS (or CPU) kernel per shape.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    x_scale = x2.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX  # [M, 1]
    xq = (x2 / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    if x.device.type == "cpu" and not _cpu_rowwise_scaled_mm():
        # Older CPU builds scale per tensor only: the same arithmetic on the dequantized operands.
        out = ((xq.float() * x_scale) @ (weight.float() * weight_scale.reshape(-1, 1)).t()).to(x.dtype)
    else:
        # _scaled_mm wants its second operand column-major: weight is [N, K] row-major, so .t() is.
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


@functools.cache
def _cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes per-row scales (2.13 does; 2.11 scales per
    tensor only and asserts otherwise)."""
    a = torch.ones(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fp8_weight: torch.Tensor | None = None,
    fp8_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, or its FP8 form when the layer holds quantized weights."""
    if fp8_weight is None or fp8_scale is None:
        return nn.functional.linear(x, weight, bias)
    return fp8_linear(x, fp8_weight, fp8_scale, bias)


def store_fp8(module: nn.Module, name: str, weight: torch.Tensor) -> None:
    """Quantize ``weight`` into ``module``'s buffers ``<name>`` (e4m3) and ``<name>_scale``.

    Buffers that already hold a tensor of the right shape are overwritten in place, so a CUDA
    graph captured over them stays valid when the weights are reloaded and quantized again.
    """
    q, scale = quantize_rows(weight.detach())
    for key, value in ((name, q), (f"{name}_scale", scale)):
        old = getattr(module, key, None)
        if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
            old.copy_(value)
        else:
            module.register_buffer(key, value, persistent=False)


@torch.no_grad()
def quantize_into(q_buf: torch.Tensor, scale_buf: torch.Tensor, weight: torch.Tensor) -> None:
    """Quantize ``weight`` ``[N, K]`` (in the model dtype, on any device: it is moved to the
    buffers' device first) into existing FP8 buffers, or row views of them, in place: ``q_buf``
    ``[N, K]`` e4m3 and ``scale_buf`` ``[1, N]``. Same bits as ``quantize_rows``; the buffers keep
    their addresses (a captured CUDA graph stays valid)."""
    q, scale = quantize_rows(weight.to(q_buf.device))
    if q.shape != q_buf.shape or scale.shape != scale_buf.shape:
        raise ValueError(f"weight shape {tuple(weight.shape)} != the FP8 buffer's {tuple(q_buf.shape)}")
    q_buf.copy_(q)
    scale_buf.copy_(scale)


def free_source(module: nn.Module, name: str) -> None:
    """Replace ``module``'s weight ``name`` (a parameter or a plain tensor attribute) by a meta
    tensor of the same shape and dtype: its memory is released (once no view of it remains), and
    reading its values fails loudly instead of computing with stale ones. Call after the layer's
    FP8 copy is made; from then on new weights must go through ``quantize_into``."""
    old = getattr(module, name)
    meta = torch.empty(old.shape, dtype=old.dtype, device="meta")
    setattr(module, name, nn.Parameter(meta, requires_grad=False) if isinstance(old, nn.Parameter) else meta)


def quantize_source_(module: nn.Module, name: str, buffer: str, *, keep_source: bool) -> bool:
    """Quantize ``module``'s weight ``name`` into its buffers ``<buffer>`` and ``<buffer>_scale``
    and free the weight unless ``keep_source``. A no-op, returning False, once it is freed: the
    FP8 copy is current (every load since wrote straight into it)."""
    weight = getattr(module, name)
    if weight.is_meta:
        return False
    store_fp8(module, buffer, weight)
    if not keep_source:
        free_source(module, name)
    return True


def quantize_fp8_(module: nn.Module, *, keep_source: bool = False) -> int:
    """Quantize every layer of ``module`` that can run in FP8 (it has ``quantize_fp8_()``), in
    place, and free each one's source weight unless ``keep_source``; returns how many weight
    matrices are quantized. A layer whose source is already freed counts but is left as is (its
    FP8 copy is current: every later load wrote straight into it)."""
    count = 0
    for sub in module.modules():
        quantize = getattr(sub, "quantize_fp8_", None)
        if callable(quantize):
            count += int(quantize(keep_source=keep_source))
    return count
