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
from kvrelay.models.parallel import ColumnParallelLinear, RowParallelLinear, TpGroup


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
    q, scale = quantize_rows(layer.weight)
    assert layer.quantize_fp8_() == 1
    assert layer.fp8_weight is not None and layer.fp8_weight_scale is not None
    assert not [k for k in layer.state_dict() if "fp8" in k]
    # the source weight is freed (shape and dtype kept, no storage); the bias stays
    assert layer.weight.is_meta and layer.weight.shape == (48, 32) and layer.weight.dtype == dtype
    assert not layer.bias.is_meta  # type: ignore[union-attr]
    out = layer(x)
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
        assert shard.weight.is_meta and shard.weight.shape == (24, 32)
        rows = slice(24 * rank, 24 * (rank + 1))
        assert torch.equal(shard.fp8_weight, q[rows])  # type: ignore[arg-type]
        assert torch.equal(shard.fp8_weight_scale, scale[:, rows])  # type: ignore[arg-type]
        assert torch.equal(shard(x), out[..., rows])
    # loading weights into the freed layer quantizes them into the same buffers, in place
    address = layer.fp8_weight.data_ptr()
    w2 = torch.randn(48, 32, generator=gen)
    layer.load_full(w2.to(dtype), bias.to(dtype))
    q2, scale2 = quantize_rows(w2.to(dtype))
    assert layer.fp8_weight.data_ptr() == address and layer.weight.is_meta
    assert torch.equal(layer.fp8_weight, q2) and torch.equal(layer.fp8_weight_scale, scale2)
    assert layer.quantize_fp8_() == 1  # already freed: counts, keeps the loaded copy
    assert torch.equal(layer.fp8_weight, q2)


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_and_fused_shards_free_their_weights_and_reload_into_fp8(rank: int) -> None:
    """TP shards (rank r of 2, one process: no collective runs) of a row-parallel linear, the fused
    gate/up and the fused q/k/v: after quantization no bf16 weight of theirs is left, each FP8
    buffer is the quantization of that rank's shard (a fused piece's rows of its owner's), and
    loading new full weights writes their quantization into the same buffers."""
    tp, dtype = TpGroup(rank, 2, None), torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    mlp, attn = SwiGLU(32, 64, tp, dtype=dtype), ParallelAttention(32, 4, 2, 8, tp, qkv_bias=True, dtype=dtype)

    def full(lin: ColumnParallelLinear | RowParallelLinear) -> torch.Tensor:
        return torch.randn(lin.out_features, lin.in_features, generator=gen).to(dtype)

    def fill() -> dict[str, torch.Tensor]:
        ws = {}
        for name, lin in (("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj),
                          ("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj)):
            ws[name] = full(lin)
            lin.load_full(ws[name], torch.zeros(lin.out_features, dtype=dtype) if lin.bias is not None else None)
        return ws

    def expect(ws: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        col = {k: tp.shard(ws[k], 0) for k in ("gate", "up", "q", "k", "v")}
        return {
            "gate_up": quantize_rows(torch.cat((col["gate"], col["up"]))),
            "qkv": quantize_rows(torch.cat((col["q"], col["k"], col["v"]))),
            "down": quantize_rows(tp.shard(ws["down"], 1)),
            "o": quantize_rows(tp.shard(ws["o"], 1)),
        }

    def held() -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        return {
            "gate_up": (mlp._gate_up_fp8, mlp._gate_up_fp8_scale),
            "qkv": (attn._qkv_fp8, attn._qkv_fp8_scale),
            "down": (mlp.down_proj.fp8_weight, mlp.down_proj.fp8_weight_scale),
            "o": (attn.o_proj.fp8_weight, attn.o_proj.fp8_weight_scale),
        }

    x = torch.randn(2, 5, 32, generator=gen).to(dtype)
    ws = fill()
    plain_qkv = attn.project_qkv(x)
    assert quantize_fp8_(mlp) == 2 and quantize_fp8_(attn) == 2
    assert [n for n, p in [*mlp.named_parameters(), *attn.named_parameters()] if not p.is_meta] == [
        "q_proj.bias", "k_proj.bias", "v_proj.bias"
    ]
    assert mlp._gate_up.is_meta and attn._qkv_weight.is_meta
    addresses = {k: (q.data_ptr(), s.data_ptr()) for k, (q, s) in held().items()}  # type: ignore[union-attr]
    for k, (q, s) in expect(ws).items():
        assert torch.equal(held()[k][0], q) and torch.equal(held()[k][1], s), k  # type: ignore[arg-type]
    fp8_qkv = attn.project_qkv(x)  # the fused FP8 GEMM with the kept bias
    assert all(_rel(a, b) < 0.1 for a, b in zip(fp8_qkv, plain_qkv, strict=True))
    ws = fill()  # new weights: straight into the FP8 buffers
    for k, (q, s) in expect(ws).items():
        assert torch.equal(held()[k][0], q) and torch.equal(held()[k][1], s), k  # type: ignore[arg-type]
    assert {k: (q.data_ptr(), s.data_ptr()) for k, (q, s) in held().items()} == addresses  # type: ignore[union-attr]
    assert all(p.is_meta for p in (mlp.gate_proj.weight, attn.q_proj.weight, attn.o_proj.weight))


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
    # the fused weights and their pieces' views of them are freed; each piece knows its FP8 rows
    assert mlp._gate_up.is_meta and attn._qkv_weight.is_meta and all(p.weight.is_meta for p in pieces)
    assert mlp.gate_proj.fp8_rows is not None and mlp.up_proj.fp8_rows is not None
    assert mlp.up_proj.fp8_rows[0].data_ptr() == mlp._gate_up_fp8[64:].data_ptr()


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


def _resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of storage (each storage once, views included) that ``module``'s parameters, buffers
    and plain tensor attributes (the fused weights, a piece's FP8 rows) keep alive, meta tensors
    (no storage) aside."""
    tensors: list[torch.Tensor] = []
    for sub in module.modules():
        tensors += [t for t in (*sub._parameters.values(), *sub._buffers.values()) if t is not None]
        for value in vars(sub).values():
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    tensors.append(t)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}
    return sum(storages.values())


def _kept_source(weight_seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> DitRunner:
    """A quantized runner as before sources were freed: the same FP8 copies, bf16 weights kept."""
    runner = DitRunner("tiny", weight_seed=weight_seed, dtype=dtype)
    quantize_fp8_(runner.model, keep_source=True)
    runner.quantization = "fp8"
    return runner


def test_a_quantized_runner_frees_the_bf16_weights_of_its_quantized_linears() -> None:
    plain = DitRunner("tiny", weight_seed=0, dtype=torch.bfloat16)
    kept = _kept_source()
    fp8 = DitRunner("tiny", weight_seed=0, dtype=torch.bfloat16, quantization="fp8")
    # what the quantized linears held in bf16: per block the fused qkv, o, fused gate/up and down
    blocks = fp8.model.blocks
    shapes = [
        shape
        for block in plain.model.blocks
        for shape in (block.attn._qkv_weight.shape, block.attn.o_proj.weight.shape,  # type: ignore[union-attr]
                      block.mlp._gate_up.shape, block.mlp.down_proj.weight.shape)  # type: ignore[union-attr]
    ]
    assert len(shapes) == 4 * len(blocks)
    bf16_bytes = sum(n * k * 2 for n, k in shapes)
    fp8_bytes = sum(n * k + n * 4 for n, k in shapes)  # e4m3 weight + fp32 row scales
    assert _resident_bytes(kept.model) == _resident_bytes(plain.model) + fp8_bytes  # the old +copy
    assert _resident_bytes(fp8.model) == _resident_bytes(kept.model) - bf16_bytes
    assert _resident_bytes(fp8.model) == _resident_bytes(plain.model) - bf16_bytes + fp8_bytes
    freed = {name for name, p in fp8.model.named_parameters() if p.is_meta}
    assert freed == {
        f"blocks.{i}.{name}.weight"
        for i in range(len(blocks))
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    # shapes and dtypes stay (only the storage went), so the model still describes itself
    for (name, a), (_, b) in zip(fp8.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if not a.is_meta:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("rowwise", [True, False], ids=["scaled_mm", "dequantized-fallback"])
def test_freeing_the_sources_changes_no_output_bit(rowwise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a runner that keeps its bf16 weights (as before they were freed): the same bits, on
    torch's per-row _scaled_mm and on the dequantized fallback of CPU builds without it."""
    import kvrelay.models.fp8 as fp8_module

    if not rowwise:
        monkeypatch.setattr(fp8_module, "_cpu_rowwise_scaled_mm", lambda: False)
    kept = _kept_source()
    fp8 = DitRunner("tiny", weight_seed=0, dtype=torch.bfloat16, quantization="fp8")
    for (name, a), (_, b) in zip(fp8.model.named_buffers(), kept.model.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    x = torch.randn(2, fp8.cfg.latent_channels, 16, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    rows = _rows(fp8)
    assert torch.equal(fp8.model(x, 0.4, rows), kept.model(x, 0.4, rows))
    kwargs = dict(width=128, height=128, steps=3, guidance_scale=2.0, seed=5)
    assert torch.equal(fp8.denoise(rows, **kwargs), kept.denoise(rows, **kwargs))


def test_loading_a_checkpoint_quantizes_again_in_place(tmp_path: Path) -> None:
    DitRunner("tiny", weight_seed=0).save_checkpoint(tmp_path)
    seeded = DitRunner("tiny", weight_seed=0, quantization="fp8")  # those weights, quantized
    target = DitRunner("tiny", weight_seed=7, quantization="fp8")
    resident = _resident_bytes(target.model)
    addresses = {name: b.data_ptr() for name, b in target.model.named_buffers()}
    before = target.model.blocks[0].mlp._gate_up_fp8  # type: ignore[union-attr]
    assert not torch.equal(before, seeded.model.blocks[0].mlp._gate_up_fp8)  # type: ignore[union-attr]
    target.load_checkpoint(tmp_path)
    # the same buffers (a captured step graph keeps reading them), no bf16 weight came back
    assert {name: b.data_ptr() for name, b in target.model.named_buffers()} == addresses
    assert _resident_bytes(target.model) == resident
    for (name, a), (_, b) in zip(target.model.named_buffers(), seeded.model.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(target.model.named_parameters(), seeded.model.named_parameters(), strict=True):
        assert a.is_meta == b.is_meta and (a.is_meta or torch.equal(a, b)), name
    x = torch.randn(2, target.cfg.latent_channels, 16, 16, generator=torch.Generator().manual_seed(3))
    rows = _rows(target)
    assert torch.equal(target.model(x, 0.7, rows), seeded.model(x, 0.7, rows))
    # a runner built from the checkpoint is that runner too
    built = DitRunner("tiny", weight_seed=7, quantization="fp8", checkpoint=tmp_path)
    assert _resident_bytes(built.model) == resident
    assert torch.equal(built.model(x, 0.7, rows), seeded.model(x, 0.7, rows))


def test_a_quantized_runner_refuses_to_save_the_weights_it_freed(tmp_path: Path) -> None:
    from kvrelay.models.loader import full_state

    fp8 = DitRunner("tiny", weight_seed=0, quantization="fp8")
    with pytest.raises(ValueError, match=r"quantized \(fp8\) and freed the bf16 weights"):
        fp8.save_checkpoint(tmp_path)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="freed by FP8 quantization"):
        full_state(fp8.model)


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
