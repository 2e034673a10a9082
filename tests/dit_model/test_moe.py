"""The MoE DiT (tiny-moe): the MoE MLP is the textbook sum over routed and shared experts, the
preset's checkpoint round-trips, and expert parallelism at EP=2 (real gloo ranks) equals EP off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models.dit import DIT_CHECKPOINT_FILE, DitRunner, random_prefix
from kvrelay.models.loader import CheckpointError
from kvrelay.models.moe import MoeMlp, route
from kvrelay.models.presets import get_preset
from kvrelay.worker import WorkerGroup

from .rank_handlers import DitRankFactory, Generate

PRESET = "tiny-moe"


def _naive(mlp: MoeMlp, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: shared(x) + sum over its top-k experts of weight * SwiGLU_e(x)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = route(mlp.router(flat), mlp.top_k)
    out = mlp.shared(flat).clone()
    for n in range(flat.shape[0]):
        for k in range(mlp.top_k):
            e = int(ids[n, k])
            gate, up = F.linear(flat[n], mlp.experts.w_gate_up[e]).chunk(2)
            out[n] += weights[n, k] * F.linear(F.silu(gate) * up, mlp.experts.w_down[e])
    return out.reshape(x.shape)


def test_moe_mlp_is_the_sum_over_routed_and_shared_experts() -> None:
    runner = DitRunner(PRESET, weight_seed=2)
    mlp = runner.model.blocks[0].mlp
    assert isinstance(mlp, MoeMlp)
    cfg = get_preset(PRESET).dit
    assert tuple(mlp.experts.w_gate_up.shape) == (cfg.num_experts, 2 * cfg.expert_mlp, cfg.hidden)
    x = torch.randn(3, 11, cfg.hidden, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mlp(x), _naive(mlp, x), atol=1e-5, rtol=1e-5)
    weights, ids = route(mlp.router(x.reshape(-1, cfg.hidden)), cfg.experts_top_k)
    torch.testing.assert_close(weights.sum(-1), torch.ones(33))
    assert len(set(ids.flatten().tolist())) > 1  # the router spreads tokens over experts
    # An expert's weights matter exactly for the tokens routed to it.
    used = int(ids[0, 0])
    before = mlp(x).reshape(-1, cfg.hidden)
    with torch.no_grad():
        mlp.experts.w_down[used].zero_()
    after = mlp(x).reshape(-1, cfg.hidden)
    hit = (ids == used).any(-1)
    assert not torch.allclose(before[hit], after[hit])
    torch.testing.assert_close(before[~hit], after[~hit])


def _image(runner: DitRunner) -> torch.Tensor:
    rows = [random_prefix(runner.preset, 7, 1), random_prefix(runner.preset, 3, 2)]
    return runner.generate(rows, width=64, height=64, steps=2, guidance_scale=2.0, seed=3)


def test_moe_checkpoint_round_trips_and_is_checked(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = DitRunner(PRESET, weight_seed=5)
    source.save_checkpoint(tmp_path)
    tensors = load_file(str(tmp_path / DIT_CHECKPOINT_FILE))
    cfg = get_preset(PRESET).dit
    assert tuple(tensors["model.blocks.1.mlp.experts.w_down"].shape) == (cfg.num_experts, cfg.hidden, cfg.expert_mlp)
    loaded = DitRunner(PRESET, weight_seed=0, checkpoint=tmp_path)
    assert torch.equal(_image(loaded), _image(source))
    assert not torch.equal(_image(DitRunner(PRESET, weight_seed=0)), _image(source))
    # Missing experts are named; a dense checkpoint does not load into the MoE preset.
    key = "model.blocks.0.mlp.experts.w_gate_up"
    save_file({k: v for k, v in tensors.items() if k != key}, str(tmp_path / DIT_CHECKPOINT_FILE))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        DitRunner(PRESET, checkpoint=tmp_path)
    DitRunner("tiny", weight_seed=1).save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError):
        DitRunner(PRESET, checkpoint=tmp_path)


def _command(width: int, height: int) -> Generate:
    preset = get_preset(PRESET)
    rows = (random_prefix(preset, 29, seed=10), random_prefix(preset, 11, seed=20))
    return Generate(full_rows=rows, width=width, height=height, steps=2, guidance_scale=2.5, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "sp", "expert_parallel", "force_gather"),
    [
        (2, 1, False, False),  # experts TP-sliced
        (2, 1, True, False),  # EP=2: all-to-all dispatch/combine
        (2, 1, True, True),  # EP=2 over the all-gather fallback
    ],
)
def test_expert_parallel_equals_single_rank(
    tmp_path: Path, tp: int, sp: int, expert_parallel: bool, force_gather: bool
) -> None:
    width, height = 80, 48  # 15 image tokens x 2 CFG rows: uneven over 2 EP ranks
    command = _command(width, height)
    single = DitRunner(PRESET, weight_seed=7)
    ref = single.denoise(list(command.full_rows), width=width, height=height, steps=2, guidance_scale=2.5, seed=3)
    # The EP ranks load the single rank's checkpoint (each keeps its experts) rather than seeds.
    single.save_checkpoint(tmp_path)
    factory = DitRankFactory(PRESET, tp, sp, 0, expert_parallel, str(tmp_path), force_gather)
    with WorkerGroup(tp * sp, factory) as group:
        results = group.call_all(command, timeout_s=120)
    cfg = get_preset(PRESET).dit
    want_local = cfg.num_experts // tp if expert_parallel else cfg.num_experts
    for r in results:
        assert r.local_experts == want_local
        torch.testing.assert_close(r.latents, ref, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(r.latents, results[0].latents) for r in results)


@pytest.mark.slow
def test_dit_parallel_benchmark_times_every_layout_side_by_side() -> None:
    from benchmarks.dit_parallel import Layout, measure

    layouts = [Layout("EP off", 2), Layout("EP on", 2, expert_parallel=True), Layout("CFG", 1, cfg_parallel=2)]
    results = measure(PRESET, layouts, width=64, height=64, steps=2, prefix_tokens=8, rounds=1)
    assert [r["layout"] for r in results] == ["EP off", "EP on", "CFG"]
    assert results[0]["ratio_to_first"] == 1.0
    assert all(float(str(r["step_s_median"])) > 0 for r in results)
