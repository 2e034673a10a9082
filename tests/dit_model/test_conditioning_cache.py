"""The per-t step conditioning (adaLN modulation of every block and the final layer, computed once
for one row and broadcast) and the runner's LRU cache of it: cached and fresh give the same bits,
a hit computes nothing, new weights drop the cache, the cache is bounded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvrelay.models import dit
from kvrelay.models.dit import DIT_CHECKPOINT_FILE, DitRunner, random_prefix, timestep_features
from kvrelay.models.sampler import flow_timesteps

PRESET = "tiny"


def _rows(runner: DitRunner) -> list:
    return [random_prefix(runner.preset, 9, seed=1), random_prefix(runner.preset, 4, seed=2)]


def _denoise(runner: DitRunner, steps: int = 2) -> torch.Tensor:
    return runner.denoise(_rows(runner), width=64, height=64, steps=steps, guidance_scale=2.0, seed=3)


def _latents(runner: DitRunner, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, runner.cfg.latent_channels, 8, 8, generator=gen).to(runner.dtype)


@pytest.fixture
def runner() -> DitRunner:
    return DitRunner(PRESET, weight_seed=0)


def test_conditioning_is_each_blocks_modulation_of_the_time_embedding(runner: DitRunner) -> None:
    model, t = runner.model, 0.8125
    cond = model.conditioning(t)
    hidden, layers = runner.cfg.hidden, runner.cfg.num_layers
    assert tuple(cond.blocks.shape) == (layers, 1, 6 * hidden) and tuple(cond.final.shape) == (1, 2 * hidden)
    assert cond.blocks.data_ptr() == cond.flat.data_ptr()  # views of one buffer: one copy refills it
    c = F.silu(model.time_out(F.silu(model.time_in(timestep_features(torch.tensor([t])).to(model.dtype)))))
    for layer, block in enumerate(model.blocks):
        assert torch.equal(cond.blocks[layer], block.modulation(c))
    assert torch.equal(cond.final, model.final_modulation(c))
    assert not torch.equal(model.conditioning(0.25).flat, cond.flat)


def test_cached_and_fresh_conditioning_give_the_same_step_bits(runner: DitRunner) -> None:
    rows, x = _rows(runner), _latents(runner)
    velocity = runner.stepper(rows, 8, 8)
    for t in flow_timesteps(3).tolist()[:3]:
        first = velocity(x, t).clone()  # miss: computes and caches
        hit = velocity(x, t).clone()  # hit: the cached tensors
        fresh = runner.model(x, t, rows)  # DitModel.forward: conditioning computed anew, no cache
        assert torch.equal(first, hit) and torch.equal(hit, fresh)
        assert torch.equal(runner.conditioning(t).flat, runner.model.conditioning(t).flat)
    # Every row of a step sees the same modulation: two identical rows give identical velocities.
    same = runner.stepper([rows[0], rows[0]], 8, 8)(x[:1].expand(2, *x.shape[1:]), 0.5)
    assert torch.equal(same[0], same[1])


def test_a_cache_hit_computes_nothing(runner: DitRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    computed: list[float] = []
    real = runner.model.conditioning

    def counting(t: float) -> dit.StepConditioning:
        computed.append(t)
        return real(t)

    monkeypatch.setattr(runner.model, "conditioning", counting)
    first = _denoise(runner)
    assert computed == [1.0, 0.5]  # 2 steps: t = 1.0, 0.5, each computed once
    assert torch.equal(_denoise(runner), first)  # the schedule repeats: all hits
    runner.denoise_batch(
        [dit.BatchRequest(_rows(runner), 2.0, seed) for seed in (1, 2)], width=64, height=64, steps=2
    )
    assert computed == [1.0, 0.5]
    assert runner.conditioning(0.5) is runner.conditioning(0.5)
    _denoise(runner, steps=4)  # t = 1.0, 0.75, 0.5, 0.25: two new values
    assert computed == [1.0, 0.5, 0.75, 0.25]


def test_the_key_is_the_exact_host_value_of_t(runner: DitRunner) -> None:
    t = 0.3
    assert runner.conditioning(t) is runner.conditioning(float(torch.tensor(t, dtype=torch.float64)))
    nudged = math.nextafter(t, 1.0)
    assert runner.conditioning(nudged) is not runner.conditioning(t)
    assert len(runner._conditionings) == 2


def test_load_checkpoint_drops_the_cached_conditionings(runner: DitRunner, tmp_path: Path) -> None:
    # A checkpoint that differs from the runner's weights in one block's adaLN weight only, so a
    # stale cached modulation would be the whole difference.
    other = DitRunner(PRESET, weight_seed=0)
    other.model.blocks[0].modulation.weight.mul_(1.5)
    other.clear_conditionings()
    other.save_checkpoint(tmp_path)
    from safetensors.torch import load_file

    assert "model.blocks.0.modulation.weight" in load_file(str(tmp_path / DIT_CHECKPOINT_FILE))
    expected = _denoise(other)

    before = _denoise(runner)
    assert runner._conditionings
    runner.load_checkpoint(tmp_path)
    assert not runner._conditionings
    after = _denoise(runner)
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)


def test_the_cache_is_a_bounded_lru(runner: DitRunner) -> None:
    bound = dit.MAX_CONDITIONINGS
    ts = [i / (bound + 8) for i in range(bound + 8)]
    first = runner.conditioning(ts[0])
    runner.conditioning(ts[1])
    for t in ts[2:bound]:
        runner.conditioning(t)
    assert len(runner._conditionings) == bound
    assert runner.conditioning(ts[0]) is first  # a hit: now the most recently used
    for t in ts[bound:]:
        runner.conditioning(t)
    assert len(runner._conditionings) == bound
    assert runner.conditioning(ts[0]) is first  # kept: it was used recently
    keys = {k[0] for k in runner._conditionings}
    evicted = [t for t in ts if dit._t_bits(t) not in keys]
    assert evicted == ts[1:9]  # the least recently used went first
