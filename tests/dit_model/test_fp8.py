"""FP8 linears of the DiT (``DitRunner(quantization="fp8")``, kvrelay.models.fp8): the arithmetic
(per-channel weight scales, per-token activation scales, one scaled GEMM), the layers that quantize
themselves (a column-parallel linear unless it is a piece of a fused weight), that a quantized runner
really runs its blocks' big linears in FP8 and stays close to the unquantized model, that reloading
weights quantizes again in place, and the clear refusals. On the CPU (torch's reference
``_scaled_mm``); the GPU cases (graph == eager with FP8, accuracy at the BAGEL-7B shape) are in
test_cuda_graphs.py and at the end of this file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.models.dit import DitRunner, random_prefix
from kvrelay.models.fp8 import FP8_DTYPE, FP8_MAX, fp8_linear, fp8_unsupported, quantize_fp8_, quantize_rows
from kvrelay.models.layers import ParallelAttention, SwiGLU
from kvrelay.models.parallel import ColumnParallelLinear, TpGroup


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_weight_rows_get_their_own_scale_and_round_trip_within_e4m3_precision() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=gen)
    w[3] *= 1000.0  # an outlier channel must not cost the others their precision
    w[7] = 0.0  # an all-zero row quantizes to zeros, not NaN
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and q.shape == (48, 80) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (1, 48)
    back = q.float() * scale.reshape(48, 1)
    assert torch.isfinite(back).all()
    assert torch.equal(back[7], torch.zeros(80))
    # every row's largest element maps to the largest e4m3 value
    nonzero = [r for r in range(48) if r != 7]
    assert torch.equal(q.float().abs().amax(dim=1)[nonzero], torch.full((47,), FP8_MAX))
    # e4m3 keeps 3 mantissa bits: relative error <= 1/16 per element (subnormals aside)
    big = w.abs() > scale.reshape(48, 1) * 2**-6
    assert ((back - w).abs()[big] <= w.abs()[big] / 16 + 1e-12).all()
    for r in nonzero:
        assert _rel(back[r], w[r]) < 0.05
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        quantize_rows(torch.zeros(2, 3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_gemm_of_the_dequantized_operands(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 64, generator=gen).to(dtype)
    x[0, 1] = 0.0  # a padding token
    w = torch.randn(32, 64, generator=gen)
    bias = torch.randn(32, generator=gen).to(dtype)
    q, scale = quantize_rows(w)
    out = fp8_linear(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (2, 5, 32)
    # reference: x quantized per token the same way, both operands dequantized, fp32 matmul
    x2 = x.reshape(10, 64).float()
    xs = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    xd = (x2 / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * xs
    ref = (xd @ (q.float() * scale.reshape(32, 1)).t()).to(dtype).reshape(2, 5, 32) + bias
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out[0, 1], bias)  # a zero token gives exactly the bias
    # and it approximates the unquantized linear
    exact = torch.nn.functional.linear(x.float(), w, bias.float())
    assert _rel(out, exact) < 0.08
    assert torch.equal(fp8_linear(x, q, scale, bias), out)  # deterministic


def test_cpu_builds_without_per_row_scaled_mm_compute_the_same_product(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvrelay.models.fp8 as fp8

    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 48, generator=gen), torch.randn(16, 48, generator=gen)
    q, scale = quantize_rows(w)
    kernel = fp8_linear(x, q, scale)
    monkeypatch.setattr(fp8, "_cpu_rowwise_scaled_mm", lambda: False)
    fallback = fp8_linear(x, q, scale)
    assert torch.allclose(fallback, kernel, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_column_parallel_linear_with_bias_quantizes_its_own_shard(dtype: torch.dtype) -> None:
    """BAGEL's unfused q/k/v projections: the FP8 GEMM of the dequantized operands plus the bias,
    and each TP rank's shard quantizes to exactly its rows of the full weight's quantization."""
    gen = torch.Generator().manual_seed(6)
    w, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(3, 7, 32, generator=gen).to(dtype)
    layer = ColumnParallelLinear(32, 48, TpGroup.single(), bias=True, dtype=dtype)
    layer.load_full(w.to(dtype), bias.to(dtype))
    plain = layer(x)
    assert torch.equal(plain, torch.nn.functional.linear(x, layer.weight, layer.bias))  # unquantized: as before
    assert layer.quantize_fp8_() == 1
    assert layer.fp8_weight is not None and layer.fp8_weight_scale is not None
    assert not [k for k in layer.state_dict() if "fp8" in k]
    out = layer(x)
    q, scale = quantize_rows(layer.weight)
    assert torch.equal(layer.fp8_weight, q) and torch.equal(layer.fp8_weight_scale, scale)
    assert torch.equal(out, fp8_linear(x, q, scale, layer.bias))
    x2 = x.reshape(21, 32).float()
    xs = x2.abs().amax(dim=1, keepdim=True) / FP8_MAX
    xd = (x2 / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * xs
    ref = (xd @ (q.float() * scale.reshape(48, 1)).t()).to(dtype).reshape(3, 7, 48) + layer.bias
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert not torch.equal(out, plain) and _rel(out, plain) < 0.08
    for rank in range(2):
        shard = ColumnParallelLinear(32, 48, TpGroup(rank, 2, None), bias=True, dtype=dtype)
        shard.load_full(w.to(dtype), bias.to(dtype))
        assert shard.quantize_fp8_() == 1
        rows = slice(24 * rank, 24 * (rank + 1))
        assert torch.equal(shard.fp8_weight, q[rows])  # type: ignore[arg-type]
        assert torch.equal(shard.fp8_weight_scale, scale[:, rows])  # type: ignore[arg-type]
        assert torch.equal(shard(x), out[..., rows])


def test_pieces_of_a_fused_weight_leave_quantization_to_its_owner() -> None:
    tp = TpGroup.single()
    mlp = SwiGLU(32, 64, tp)
    attn = ParallelAttention(32, 4, 2, 8, tp, qkv_bias=True)
    pieces = (mlp.gate_proj, mlp.up_proj, attn.q_proj, attn.k_proj, attn.v_proj)
    assert all(p.fused for p in pieces)
    assert not ColumnParallelLinear(32, 16, tp).fused
    assert [p.quantize_fp8_() for p in pieces] == [0] * 5
    assert all(p.fp8_weight is None for p in pieces)
    # the walker: fused gate/up + down, fused qkv + o; the pieces add nothing
    assert quantize_fp8_(mlp) == 2 and quantize_fp8_(attn) == 2
    assert mlp._gate_up_fp8 is not None and attn._qkv_fp8 is not None
    assert all(p.fp8_weight is None for p in pieces)
    assert not [b for p in pieces for b in p.buffers()]


def _rows(runner: DitRunner) -> list:
    return [
        random_prefix(runner.preset, n, seed=10 + i, dtype=runner.dtype, device=runner.device)
        for i, n in enumerate((9, 4))
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_runner_runs_its_big_linears_in_fp8_close_to_the_unquantized_model(dtype: torch.dtype) -> None:
    plain = DitRunner("tiny", weight_seed=0, dtype=dtype)
    fp8 = DitRunner("tiny", weight_seed=0, dtype=dtype, quantization="fp8")
    assert plain.quantization is None and fp8.quantization == "fp8"
    fp8_buffers = {name: b for name, b in fp8.model.named_buffers() if b.dtype == FP8_DTYPE}
    # per block: fused qkv, o_proj, fused gate/up, down_proj
    assert len(fp8_buffers) == 4 * fp8.cfg.num_layers
    assert not [b for b in plain.model.buffers() if b.dtype == FP8_DTYPE]
    # the FP8 copies are not part of the checkpoint state
    assert not [k for k in fp8.model.state_dict() if "fp8" in k]
    x = torch.randn(2, fp8.cfg.latent_channels, 16, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows = _rows(fp8)
    v_plain, v_fp8 = plain.model(x, 0.4, rows), fp8.model(x, 0.4, rows)
    assert torch.isfinite(v_fp8.float()).all()
    assert not torch.equal(v_plain, v_fp8)  # the FP8 path really ran
    assert _rel(v_fp8, v_plain) < 0.05
    assert torch.equal(fp8.model(x, 0.4, rows), v_fp8)
    # a whole denoise stays close too
    kwargs = dict(width=128, height=128, steps=3, guidance_scale=2.0, seed=5)
    lat_plain, lat_fp8 = plain.denoise(rows, **kwargs), fp8.denoise(rows, **kwargs)
    assert torch.isfinite(lat_fp8.float()).all()
    assert _rel(lat_fp8, lat_plain) < 0.05


def test_loading_a_checkpoint_quantizes_again_in_place(tmp_path: Path) -> None:
    source = DitRunner("tiny", weight_seed=0, quantization="fp8")
    source.save_checkpoint(tmp_path)
    target = DitRunner("tiny", weight_seed=7, quantization="fp8")
    block = target.model.blocks[0]
    before = block.mlp._gate_up_fp8  # type: ignore[union-attr]
    address = before.data_ptr()
    assert not torch.equal(before, source.model.blocks[0].mlp._gate_up_fp8)  # type: ignore[union-attr]
    target.load_checkpoint(tmp_path)
    after = block.mlp._gate_up_fp8  # type: ignore[union-attr]
    assert after.data_ptr() == address  # the same buffer (a captured step graph keeps reading it)
    for (name, a), (_, b) in zip(target.model.named_buffers(), source.model.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    x = torch.randn(2, target.cfg.latent_channels, 16, 16, generator=torch.Generator().manual_seed(3))
    rows = _rows(target)
    assert torch.equal(target.model(x, 0.7, rows), source.model(x, 0.7, rows))


def test_quantization_refusals_say_why() -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        DitRunner("tiny", quantization="int4")
    with pytest.raises(ValueError, match="MoE preset 'tiny-moe'"):
        DitRunner("tiny-moe", quantization="fp8")
    with pytest.raises(ValueError, match="float16"):
        DitRunner("tiny", dtype=torch.float16, quantization="fp8")
    assert fp8_unsupported(torch.device("cpu"), torch.bfloat16) is None
    assert fp8_unsupported(torch.device("cpu"), torch.float32) is None


@pytest.mark.gpu
def test_fp8_step_stays_close_to_bf16_at_the_bagel_7b_shape() -> None:
    """At the served shape (28 layers, 2 CFG rows of 1,024 image tokens), one step of the FP8
    model against the bf16 one, both eager, same inputs."""
    plain = DitRunner("bagel-7b-shape", weight_seed=0, device="cuda", cuda_graphs=False)
    fp8 = DitRunner("bagel-7b-shape", weight_seed=0, device="cuda", cuda_graphs=False, quantization="fp8")
    rows = [random_prefix(plain.preset, n, seed=n, dtype=plain.dtype, device="cuda") for n in (81, 16)]
    x = torch.randn(2, plain.cfg.latent_channels, 64, 64, generator=torch.Generator().manual_seed(4))
    x = x.to("cuda", plain.dtype)
    v_plain, v_fp8 = plain.model(x, 0.6, rows), fp8.model(x, 0.6, rows)
    rel = _rel(v_fp8, v_plain)
    cos = float(torch.nn.functional.cosine_similarity(v_fp8.float().flatten(), v_plain.float().flatten(), dim=0))
    print(f"bagel-7b-shape step, fp8 vs bf16: relative error {rel:.4f}, cosine {cos:.6f}")
    assert torch.isfinite(v_fp8.float()).all()
    assert rel < 0.1 and cos > 0.99
