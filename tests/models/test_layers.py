"""Building blocks in one process: attention masks, RoPE, norms, presets."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvrelay.models.layers import RMSNorm, apply_rotary, attention, rope_cos_sin, torch_dtype
from kvrelay.models.parallel import TpGroup, choose_backend
from kvrelay.models.presets import PRESETS, get_preset
from tests.models.rank_handlers import run_attention_block


def _naive_attention(q, k, v, causal):
    groups = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(groups, dim=-3)
    v = v.repeat_interleave(groups, dim=-3)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        tq, tk = q.shape[-2], k.shape[-2]
        keep = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tq,tk", [(6, 6), (4, 10)])
def test_attention_matches_naive_gqa(causal, tq, tk):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, tq, 16, generator=g)
    k = torch.randn(2, 4, tk, 16, generator=g)
    v = torch.randn(2, 4, tk, 16, generator=g)
    torch.testing.assert_close(
        attention(q, k, v, causal), _naive_attention(q, k, v, causal), rtol=1e-5, atol=1e-5
    )


def test_causal_attention_over_prefix_equals_tail_of_full_causal():
    # Queries after a cached prefix must see exactly what they would in one full causal pass.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 12, 16, generator=g)
    k = torch.randn(1, 4, 12, 16, generator=g)
    v = torch.randn(1, 4, 12, 16, generator=g)
    full = attention(q, k, v, causal=True)
    tail = attention(q[..., 7:, :], k, v, causal=True)
    torch.testing.assert_close(tail, full[..., 7:, :], rtol=1e-6, atol=1e-6)


def test_attention_is_deterministic_bitwise():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 33, 16, generator=g) for _ in range(3))
    assert torch.equal(attention(q, k, v, True), attention(q.clone(), k.clone(), v.clone(), True))


def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 1, 32, generator=g)
    k = torch.randn(1, 1, 1, 32, generator=g)
    cos, sin = rope_cos_sin(torch.arange(64), 32, 10000.0)

    def score(pq: int, pk: int) -> float:
        qr = apply_rotary(q, cos[pq : pq + 1], sin[pq : pq + 1])
        kr = apply_rotary(k, cos[pk : pk + 1], sin[pk : pk + 1])
        return float((qr * kr).sum())

    assert score(10, 3) == pytest.approx(score(40, 33), rel=1e-4, abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 9), rel=1e-3)
    # Position 0 is the identity rotation.
    torch.testing.assert_close(apply_rotary(q, cos[:1], sin[:1]), q)


def test_rmsnorm_unit_rms_in_bf16_from_fp32_statistics():
    x = torch.randn(4, 128) * 1e-2
    y = RMSNorm(128, dtype=torch.bfloat16)(x.bfloat16())
    assert y.dtype == torch.bfloat16
    rms = y.float().pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(4), rtol=2e-2, atol=2e-2)


def test_attention_block_single_rank_is_deterministic():
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    a, ka = run_attention_block(TpGroup.single(), 7, x)
    b, kb = run_attention_block(TpGroup.single(), 7, x)
    assert torch.equal(a, b) and torch.equal(ka, kb)
    c, _ = run_attention_block(TpGroup.single(), 8, x)
    assert not torch.allclose(a, c)


def test_presets_share_geometry_and_shapes():
    assert set(PRESETS) == {"tiny", "small", "bagel-7b-shape", "tiny-moe", "hunyuan-moe-shape"}
    bagel = get_preset("bagel-7b-shape")
    assert (bagel.num_layers, bagel.ar.hidden, bagel.ar.num_heads, bagel.num_kv_heads, bagel.head_dim) == (
        28,
        3584,
        28,
        4,
        128,
    )
    assert bagel.ar.mlp == 18944 and bagel.dtype == "bfloat16"
    for preset in PRESETS.values():
        assert preset.dit.num_image_tokens(512, 512) == 1024
        assert preset.ar.num_kv_heads == preset.dit.num_kv_heads == preset.num_kv_heads
        torch_dtype(preset.dtype)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("huge")


def test_choose_backend():
    assert choose_backend(["cpu", "cpu"]) == "gloo"
    assert choose_backend(["cuda:0", "cuda:1"]) == "nccl"
    assert choose_backend(["cuda:0", "cuda:0"]) == "gloo"


def test_importing_kvrelay_and_presets_does_not_import_torch():
    code = "import sys, kvrelay, kvrelay.models.presets, kvrelay.worker; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


SERVICE_START = """
import sys
from kvrelay.config import load_config
from kvrelay.dit_service.main import model_max_image_side
from kvrelay.models.stage import stage_preset
from kvrelay.worker import WorkerGroup

cfg = load_config(sys.argv[1])
for stage in cfg.stages:
    assert stage_preset(stage.model).name == "tiny"
    assert model_max_image_side(stage.model) == 0
assert WorkerGroup(1, print, devices=["cpu"]).backend == "gloo"
assert "torch" not in sys.modules, "the service imported torch before spawning its ranks"
"""


def test_a_service_of_a_preset_picks_its_preset_and_rank_backend_without_torch(repo_root):
    """What an AR or DiT service does before it spawns its ranks imports no torch: the backend
    choice imported kvrelay.models.parallel, the DiT's preset kvrelay.models.bagel (each a torch
    import of several seconds in the service, before ranks that import it again)."""
    config = repo_root / "tests" / "configs" / "test-fast.yaml"
    subprocess.run([sys.executable, "-c", SERVICE_START, str(config)], check=True)
