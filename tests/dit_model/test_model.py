"""The DiT runner in one process: determinism, CFG rows, cancellation, image and PNG output."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.dit import DitRunner, random_prefix
from kvrelay.models.image import decode_png, encode_png, png_size

PRESET = "tiny"


@pytest.fixture(scope="module")
def runner() -> DitRunner:
    return DitRunner(PRESET, weight_seed=0)


def _rows(runner: DitRunner, guidance: float, lengths=(13, 6)) -> list:
    rows = [
        random_prefix(runner.preset, lengths[0], seed=100),
        random_prefix(runner.preset, lengths[1], seed=200),
    ]
    return rows[:1] if guidance == 1.0 else rows


def _generate(runner: DitRunner, *, guidance: float = 2.0, seed: int = 0, rows=None, **kw) -> torch.Tensor:
    args = dict(width=64, height=64, steps=2, guidance_scale=guidance, seed=seed) | kw
    return runner.generate(rows if rows is not None else _rows(runner, guidance), **args)


def test_same_seeds_same_image_across_runners(runner: DitRunner) -> None:
    a = _generate(runner, seed=5)
    b = _generate(DitRunner(PRESET, weight_seed=0), seed=5)
    assert a.dtype == torch.uint8 and tuple(a.shape) == (64, 64, 3)
    assert torch.equal(a, b)
    assert not torch.equal(a, _generate(runner, seed=6))  # the noise seed matters
    assert not torch.equal(a, _generate(DitRunner(PRESET, weight_seed=1), seed=5))  # the weights matter


def test_image_depends_on_the_prefix_and_on_guidance(runner: DitRunner) -> None:
    base = runner.denoise(_rows(runner, 2.0), width=64, height=64, steps=2, guidance_scale=2.0, seed=1)
    other_prompt = [random_prefix(runner.preset, 13, seed=101), _rows(runner, 2.0)[1]]
    other_negative = [_rows(runner, 2.0)[0], random_prefix(runner.preset, 6, seed=201)]
    for rows in (other_prompt, other_negative):
        changed = runner.denoise(rows, width=64, height=64, steps=2, guidance_scale=2.0, seed=1)
        assert (changed - base).abs().max() > 1e-3
    weaker = runner.denoise(_rows(runner, 2.0), width=64, height=64, steps=2, guidance_scale=1.5, seed=1)
    assert (weaker - base).abs().max() > 1e-3


def test_guidance_one_runs_one_row(runner: DitRunner, monkeypatch) -> None:
    batch_rows: list[int] = []
    real_step = runner.model.step

    def spy(latents, cond, inputs, abort=None):
        batch_rows.append(latents.shape[0])
        return real_step(latents, cond, inputs, abort)

    monkeypatch.setattr(runner.model, "step", spy)
    _generate(runner, guidance=1.0, steps=3)
    assert batch_rows == [1, 1, 1]
    batch_rows.clear()
    _generate(runner, guidance=2.0, steps=3)
    assert batch_rows == [2, 2, 2]  # both CFG rows in one batched forward per step
    monkeypatch.undo()
    with pytest.raises(ValueError, match="needs 1 CFG row"):
        _generate(runner, guidance=1.0, rows=_rows(runner, 2.0))
    with pytest.raises(ValueError, match="needs 2 CFG row"):
        _generate(runner, guidance=3.0, rows=_rows(runner, 1.0))


def test_step_callback_streams_progress_and_stops_denoising(runner: DitRunner, monkeypatch) -> None:
    forwards: list[int] = []
    real_step = runner.model.step

    def spy(latents, cond, inputs, abort=None):
        forwards.append(1)
        return real_step(latents, cond, inputs, abort)

    monkeypatch.setattr(runner.model, "step", spy)

    class Cancelled(Exception):
        pass

    progress: list[tuple[int, int]] = []

    def on_step(step: int, total: int) -> None:
        progress.append((step, total))
        if step == 2:
            raise Cancelled

    with pytest.raises(Cancelled):
        _generate(runner, steps=50, on_step=on_step)
    monkeypatch.undo()
    assert progress == [(1, 50), (2, 50)]
    assert len(forwards) == 2  # no model evaluation after the callback asked to stop


def test_prefix_of_the_wrong_shard_is_rejected(runner: DitRunner) -> None:
    rows = _rows(runner, 1.0)
    half_heads = [[(k[:2], v[:2]) for k, v in rows[0]]]
    with pytest.raises(ValueError, match="heads of shard 0/1"):
        _generate(runner, guidance=1.0, rows=half_heads)
    with pytest.raises(ValueError, match="layers"):
        _generate(runner, guidance=1.0, rows=[rows[0][:1]])


@pytest.mark.parametrize(("width", "height"), [(96, 64), (64, 80)])
def test_png_round_trip_at_the_requested_size(runner: DitRunner, width: int, height: int) -> None:
    image = _generate(runner, width=width, height=height)
    assert tuple(image.shape) == (height, width, 3)
    assert image.float().std() > 10.0  # not a blank image
    data = encode_png(image)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert png_size(data) == (width, height)
    assert torch.equal(torch.from_numpy(decode_png(data)), image)


def test_bad_image_sizes_are_rejected(runner: DitRunner) -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        _generate(runner, width=72, height=64)


def test_small_preset_512_is_fast_enough() -> None:
    """`small` at 512x512 with 2 steps must take seconds on 2 cores (docs/dit.md has the numbers)."""
    import time

    small = DitRunner("small", weight_seed=0)
    rows = [random_prefix(small.preset, 32, seed=1), random_prefix(small.preset, 24, seed=2)]
    start = time.perf_counter()
    image = small.generate(rows, width=512, height=512, steps=2, guidance_scale=2.0, seed=0)
    elapsed = time.perf_counter() - start
    assert tuple(image.shape) == (512, 512, 3)
    assert elapsed < 10.0, f"small 512x512 2 steps took {elapsed:.1f}s"


def test_image_rope_positions_start_at_each_rows_prefix_length(runner: DitRunner, monkeypatch) -> None:
    import kvrelay.models.dit as model_module

    starts: list[tuple[int, int]] = []
    real = model_module.rope_cos_sin

    def spy(positions, head_dim, theta, *, dtype):
        starts.append((int(positions[0]), int(positions[-1])))
        return real(positions, head_dim, theta, dtype=dtype)

    monkeypatch.setattr(model_module, "rope_cos_sin", spy)
    _generate(runner, rows=_rows(runner, 2.0, lengths=(13, 6)), steps=1)  # 64x64 -> 16 image tokens
    assert starts == [(13, 13 + 15), (6, 6 + 15)]


def test_batched_denoise_matches_each_request_alone_and_drops_stopped_requests(runner: DitRunner) -> None:
    from kvrelay.models.dit import BatchRequest

    a = BatchRequest(_rows(runner, 2.0, lengths=(13, 6)), 2.0, seed=1)
    b = BatchRequest(_rows(runner, 1.0, lengths=(9, 9)), 1.0, seed=2)
    c = BatchRequest(_rows(runner, 2.0, lengths=(5, 20)), 3.0, seed=3)
    kwargs = dict(width=64, height=64, steps=3)
    alone = [runner.denoise(r.prefix_rows, guidance_scale=r.guidance_scale, seed=r.seed, **kwargs) for r in (a, b, c)]
    # One request in a batch is exactly the single-request denoise.
    assert torch.equal(runner.denoise_batch([a], **kwargs)[0], alone[0])
    seen: list[tuple[int, list[int]]] = []

    def on_step(step: int, total: int, active: list[int]) -> set[int]:
        seen.append((step, active))
        return {1} if step == 1 else set()

    together = runner.denoise_batch([a, b, c], on_step=on_step, **kwargs)
    assert seen == [(1, [0, 1, 2]), (2, [0, 2]), (3, [0, 2])]  # b stopped after step 1
    assert together[1] is None
    for got, want in ((together[0], alone[0]), (together[2], alone[2])):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # stacked rows: other matmul shapes
    assert not torch.allclose(together[0], together[2])


def _count_blocks(runner: DitRunner) -> tuple[list[int], list]:
    ran: list[int] = []
    hooks = [block.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, block in enumerate(runner.model.blocks)]
    return ran, hooks


def test_abort_stops_the_running_step_at_the_next_block(runner: DitRunner) -> None:
    """A cancel seen mid-step abandons the step before the next block (a long CPU step does not
    run to its end), on the eager path; an abort check that never fires changes no bit."""
    from kvrelay.models.dit import StepAborted

    args = dict(width=64, height=64, steps=3, guidance_scale=2.0, seed=4)
    undisturbed = runner.denoise(_rows(runner, 2.0), **args)
    assert torch.equal(runner.denoise(_rows(runner, 2.0), abort=lambda: False, **args), undisturbed)
    assert runner.last_abort is None

    checks: list[int] = []

    def abort() -> bool:
        checks.append(1)
        return len(checks) >= 4  # the 4th check: before block 1 of step 2 (tiny has 2 blocks)

    steps_seen: list[int] = []
    ran, hooks = _count_blocks(runner)
    try:
        with pytest.raises(StepAborted) as info:
            runner.denoise(_rows(runner, 2.0), abort=abort, on_step=lambda k, n: steps_seen.append(k), **args)
    finally:
        for h in hooks:
            h.remove()
    assert (info.value.block, info.value.chunk) == (1, 0)
    assert runner.last_abort == (2, 1, 0)
    assert steps_seen == [1]
    assert ran == [0, 1, 0]  # step 1 whole, then block 0 of step 2 only
    assert len(checks) == 4


def test_batch_aborts_mid_step_only_once_every_request_is_cancelled(runner: DitRunner) -> None:
    """The service's rule: a cancelled request beside a live one leaves at the step's end (the live
    one's latents are bit-equal to the same batch without the abort check); once every request
    left is cancelled, the step is abandoned at the next block."""
    from kvrelay.models.dit import BatchRequest

    a = BatchRequest(_rows(runner, 2.0, lengths=(13, 6)), 2.0, seed=1)
    c = BatchRequest(_rows(runner, 2.0, lengths=(5, 20)), 3.0, seed=3)
    kwargs = dict(width=64, height=64, steps=4)

    def scenario(with_abort: bool, cancel_c_at: int | None) -> tuple[list, list[list[int]], list[int]]:
        cancelled: set[int] = set()
        checks: list[int] = []
        asked: list[list[int]] = []

        def abort(active: list[int]) -> bool:
            checks.append(1)
            if len(checks) == 3:
                cancelled.add(0)  # a's cancel lands mid-step 2 (before its block 1)
            if cancel_c_at is not None and len(checks) == cancel_c_at:
                cancelled.add(1)
            asked.append(list(active))
            return all(j in cancelled for j in active)

        def on_step(step: int, total: int, active: list[int]) -> set[int]:
            if not with_abort:  # the same arrival times, seen at the step boundary only
                cancelled.add(0) if step >= 2 else None
            return {j for j in active if j in cancelled}

        out = runner.denoise_batch([a, c], on_step=on_step, abort=abort if with_abort else None, **kwargs)
        return out, asked, checks

    plain, _, _ = scenario(False, None)
    mixed, asked, _ = scenario(True, None)
    assert mixed[0] is None and plain[0] is None  # a left after step 2 in both
    assert mixed[1] is not None and plain[1] is not None
    assert torch.equal(mixed[1], plain[1])  # the live request: not one bit changed
    assert runner.last_abort is None
    assert asked[:4] == [[0, 1]] * 4 and asked[4:] == [[1]] * 4  # 2 blocks x 4 steps

    ran, hooks = _count_blocks(runner)
    try:
        both, asked, _ = scenario(True, 6)  # c cancelled too, before block 1 of step 3
    finally:
        for h in hooks:
            h.remove()
    assert both == [None, None]
    assert runner.last_abort == (3, 1, 0)
    assert ran == [0, 1, 0, 1, 0]


def test_abort_points_between_attention_chunks(runner: DitRunner, monkeypatch) -> None:
    """Inside a block, the attention's folded queries run in chunks with an abort check between
    them: chunked attention gives the same bits as one call (a check that never fires changes no
    bit), and a check that fires stops the step between two chunks of the block's attention."""
    from kvrelay.models import paged_attention
    from kvrelay.models.dit import StepAborted

    args = dict(width=64, height=64, steps=2, guidance_scale=2.0, seed=4)
    undisturbed = runner.denoise(_rows(runner, 2.0), **args)
    monkeypatch.setattr(paged_attention, "ATTENTION_CHUNK", 8)  # 16 tokens x group 2 = 32: 4 chunks
    calls: list[int] = []
    real = paged_attention.F.scaled_dot_product_attention

    def spy(q, keys, values, attn_mask=None):
        calls.append(q.shape[2])
        return real(q, keys, values, attn_mask=attn_mask)

    monkeypatch.setattr(paged_attention.F, "scaled_dot_product_attention", spy)
    checks: list[int] = []

    def never() -> bool:
        checks.append(1)
        return False

    assert torch.equal(runner.denoise(_rows(runner, 2.0), abort=never, **args), undisturbed)
    assert calls == [8] * 16  # 4 chunks x 2 blocks x 2 steps
    assert len(checks) == 16  # per block: 1 before it + 3 between its chunks

    calls.clear()
    checks.clear()

    def at_seventh() -> bool:
        checks.append(1)
        return len(checks) >= 7  # block 1 of step 1: before it (5th), after chunks 1, 2 (6th, 7th)

    with pytest.raises(StepAborted) as info:
        runner.denoise(_rows(runner, 2.0), abort=at_seventh, **args)
    assert (info.value.block, info.value.chunk) == (1, 2)
    assert runner.last_abort == (1, 1, 2)
    assert calls == [8] * 6  # block 0's 4 chunks, then 2 of block 1's
