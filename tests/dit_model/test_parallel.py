"""TP=2, SP=2 and TP=2 x SP=2 DiT ranks in real worker processes (gloo on CPU) produce the TP=1
image within fp32 tolerance; a cancel on one rank stops every rank after the same step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.models.dit import DenoiseCancelled, DitRunner, random_prefix
from kvrelay.worker import WorkerCommandError, WorkerGroup

from .rank_handlers import DitRankFactory, Generate, GenerateBatch, StopRequested

pytestmark = pytest.mark.slow

PRESET, WEIGHT_SEED = "tiny", 4


def _command(width: int, height: int, **kw) -> Generate:
    preset = DitRunner(PRESET).preset
    rows = (random_prefix(preset, 29, seed=10), random_prefix(preset, 11, seed=20))
    return Generate(full_rows=rows, width=width, height=height, steps=2, guidance_scale=2.5, seed=3, **kw)


@pytest.mark.parametrize(
    ("tp", "sp", "width", "height"),
    [
        (2, 1, 128, 128),
        (1, 2, 128, 128),
        (1, 2, 80, 48),  # 15 image tokens: uneven over 2 SP ranks, padded and masked
        (2, 2, 96, 64),
    ],
)
def test_parallel_image_equals_single_rank(tp: int, sp: int, width: int, height: int) -> None:
    command = _command(width, height)
    single = DitRunner(PRESET, weight_seed=WEIGHT_SEED)
    ref_latents = single.denoise(
        list(command.full_rows), width=width, height=height, steps=2, guidance_scale=2.5, seed=3
    )
    ref_image = single.decode(ref_latents)

    with WorkerGroup(tp * sp, DitRankFactory(PRESET, tp, sp, WEIGHT_SEED)) as group:
        results = group.call_all(command, timeout_s=120)

    assert [r.page_shard for r in results] == list(range(tp * sp))
    for r in results:
        assert r.steps_seen == [1, 2]
        torch.testing.assert_close(r.latents, ref_latents, atol=1e-4, rtol=1e-4)
        assert tuple(r.image.shape) == (height, width, 3)
        assert (r.image.int() - ref_image.int()).abs().max().item() <= 1  # uint8 rounding only
    # Every rank ends with the same latents and image: the service may take it from any rank.
    assert all(torch.equal(r.latents, results[0].latents) for r in results)
    assert all(torch.equal(r.image, results[0].image) for r in results)


def test_cancel_on_one_rank_stops_all_ranks_after_that_step() -> None:
    with WorkerGroup(2, DitRankFactory(PRESET, 1, 2, WEIGHT_SEED)) as group:
        with pytest.raises(WorkerCommandError) as info:
            group.call_all(_command(64, 64, stop_on_rank=1, stop_after_step=1), timeout_s=120)
        errors = {e.rank: e for e in info.value.errors}
        assert sorted(errors) == [0, 1]
        assert errors[1].error_type == StopRequested.__name__
        assert errors[0].error_type == DenoiseCancelled.__name__
        for e in errors.values():
            assert "[steps_seen=[1]]" in e.message  # both stopped after step 1 of 2
        # No rank is left inside a collective: the group still serves the next request.
        again = group.call_all(_command(64, 64), timeout_s=120)
        assert [r.steps_seen for r in again] == [[1, 2], [1, 2]]


@pytest.mark.parametrize(("tp", "sp", "cfg"), [(1, 2, 1), (2, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("chunk", [0, 8])
def test_abort_on_one_rank_stops_every_rank_at_the_same_point(tp: int, sp: int, cfg: int, chunk: int) -> None:
    """World size 2 over gloo: rank 1 alone sees the cancel mid-step 2; every rank abandons step 2
    at the same point (the vote at every point), none is left in a collective, and the group
    serves the next request. chunk 0: the points are the 2 blocks of tiny (rank 1's 4th check is
    before block 1 of step 2); chunk 8: 64x64 has 16 image tokens, 32 folded queries, so each
    block's attention also stops between its 4 chunks (8 checks a step; the 11th is after chunk 2
    of block 0 of step 2). cfg=2 with guidance 1: rank 1's CFG group has no row to compute and
    makes the same checks beside rank 0's forward."""
    guidance = 1.0 if cfg == 2 else 2.5
    preset = DitRunner(PRESET).preset
    rows = (random_prefix(preset, 29, seed=10),) if cfg == 2 else _command(64, 64).full_rows
    command = Generate(full_rows=rows, width=64, height=64, steps=3, guidance_scale=guidance, seed=3,
                       abort_on_rank=1, abort_at_check=11 if chunk else 4, attention_chunk=chunk)
    where, checks, at = ("in block 0 after attention chunk 2", 11, (2, 0, 2)) if chunk else ("before block 1", 4, (2, 1, 0))
    factory = DitRankFactory(PRESET, tp, sp, WEIGHT_SEED, cfg_parallel=cfg)
    with WorkerGroup(2, factory) as group:
        with pytest.raises(WorkerCommandError) as info:
            group.call_all(command, timeout_s=120)
        errors = {e.rank: e for e in info.value.errors}
        assert sorted(errors) == [0, 1]
        for e in errors.values():
            assert e.message.startswith(f"StepAborted: step aborted {where} of 2 blocks"), e.message
            assert f"[steps_seen=[1]] [checks={checks}] [last_abort={at}]" in e.message, e.message
        again = group.call_all(dataclasses.replace(command, abort_at_check=10**6), timeout_s=120)
        assert [r.steps_seen for r in again] == [[1, 2, 3], [1, 2, 3]]
        assert torch.equal(again[0].latents, again[1].latents)


@pytest.mark.parametrize(("tp", "sp"), [(1, 1), (2, 1)])
def test_cfg_parallel_image_equals_single_rank(tp: int, sp: int) -> None:
    """cfg_parallel=2: each CFG row on its own rank group (fed only that row's KV), one
    all-gather per step combines; the latents equal one rank computing both rows."""
    width, height = 80, 48
    command = _command(width, height)
    single = DitRunner(PRESET, weight_seed=WEIGHT_SEED)
    ref = single.denoise(list(command.full_rows), width=width, height=height, steps=2, guidance_scale=2.5, seed=3)
    factory = DitRankFactory(PRESET, tp, sp, WEIGHT_SEED, cfg_parallel=2)
    with WorkerGroup(2 * tp * sp, factory) as group:
        results = group.call_all(command, timeout_s=120)
    assert [r.page_shard for r in results] == [s for _ in range(2) for s in range(tp * sp)]
    for r in results:
        assert r.steps_seen == [1, 2]
        torch.testing.assert_close(r.latents, ref, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(r.latents, results[0].latents) for r in results)


def test_cfg_parallel_batch_mixes_guidance_and_equals_single_rank() -> None:
    """denoise_batch on CFG=2 ranks: a two-row request (rows on groups 0 and 1) and a one-row
    request (guidance 1: group 0 computes, group 1 only joins the combine) in one batch give the
    one-rank batch's latents; every rank ends with the same latents."""
    width, height = 64, 48
    preset = DitRunner(PRESET).preset
    two = _command(width, height)
    one = Generate(full_rows=(random_prefix(preset, 17, seed=30),), width=width, height=height, steps=2,
                   guidance_scale=1.0, seed=5)
    single = DitRunner(PRESET, weight_seed=WEIGHT_SEED)
    refs = [
        single.denoise(list(c.full_rows), width=width, height=height, steps=2, guidance_scale=c.guidance_scale,
                       seed=c.seed)
        for c in (two, one)
    ]
    with WorkerGroup(2, DitRankFactory(PRESET, 1, 1, WEIGHT_SEED, cfg_parallel=2)) as group:
        results = group.call_all(GenerateBatch((two, one)), timeout_s=120)
    for per_rank in results:
        for got, ref in zip(per_rank, refs, strict=True):
            assert got is not None
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
