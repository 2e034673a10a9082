"""A cancel on a GPU, where a step is one captured CUDA graph (no abort point inside it): the
denoise stops at the first step boundary after the cancel, no per-block check runs, and the
graphs and step buffers it leaves behind give the next denoise the same bits as before. In a
batch, the cancelled request leaves at that boundary and the other runs on to its end, bit for
bit the same on a second run.

The runner is warmed up first, as the DiT service's is before it reports SERVING
(dit_service/engine.py): its blocks are torch.compile'd with shapes dynamic after the first change,
and the warm-up compiles the shape-generic code before any request. What is compared is one
runner's output before and after a cancel, never two runners': on a GPU two runners (or two
processes) may run other compiled kernels and differ in low bf16 bits (docs/dit.md, Exactness;
on an H100 at 18676a6 and at 0a8a042, warmed up or not, a fresh runner's denoise differed from the
module's in this process).
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.dit import BatchRequest, DenoiseCancelled, DitRunner, random_prefix

pytestmark = pytest.mark.gpu

ARGS = dict(width=512, height=512, steps=6, guidance_scale=2.0, seed=4)


class _Cancel(Exception):
    pass


@pytest.fixture(scope="module")
def runner() -> DitRunner:
    runner = DitRunner("small", weight_seed=0, device="cuda")
    runner.warm_up()
    return runner


def _rows(runner: DitRunner, lengths: tuple[int, ...], seed: int) -> list:
    dtype = getattr(torch, runner.preset.dtype)
    return [random_prefix(runner.preset, n, seed=seed + i, dtype=dtype, device="cuda") for i, n in enumerate(lengths)]


def test_a_cancel_stops_a_graph_denoise_at_the_step_boundary_and_leaves_its_graphs_intact(runner: DitRunner) -> None:
    assert runner.use_graphs
    rows = _rows(runner, (77, 12), seed=9)
    reference = runner.denoise(rows, **ARGS).clone()
    seen: list[int] = []
    checks: list[int] = []

    def on_step(step: int, total: int) -> None:
        seen.append(step)
        if step == 2:
            raise _Cancel

    with pytest.raises((_Cancel, DenoiseCancelled)):
        runner.denoise(rows, on_step=on_step, abort=lambda: checks.append(1) or False, **ARGS)
    assert seen == [1, 2]  # stopped at the boundary after the cancel: steps 3..6 never ran
    assert checks == []  # a captured step is not interrupted: no per-block check on a GPU
    assert runner.last_abort is None
    assert torch.equal(runner.denoise(rows, **ARGS), reference)


def test_a_cancelled_request_leaves_a_graph_batch_and_the_other_runs_to_its_end(runner: DitRunner) -> None:
    a = BatchRequest(_rows(runner, (40, 9), seed=1), 2.0, seed=1)
    c = BatchRequest(_rows(runner, (100, 30), seed=3), 3.0, seed=3)
    asked: list[list[int]] = []

    def on_step(step: int, total: int, active: list[int]) -> set[int]:
        asked.append(list(active))
        return {0} if step == 2 and 0 in active else set()

    kwargs = dict(width=512, height=512, steps=5)
    rows = _rows(runner, (77, 12), seed=9)
    before = runner.denoise(rows, **ARGS).clone()
    out = runner.denoise_batch([a, c], on_step=on_step, **kwargs)
    assert out[0] is None
    assert out[1] is not None and torch.isfinite(out[1].float()).all()
    assert asked == [[0, 1], [0, 1], [1], [1], [1]]  # a left after step 2, c ran all 5
    first = out[1].clone()
    asked.clear()
    again = runner.denoise_batch([a, c], on_step=on_step, **kwargs)
    assert again[0] is None and torch.equal(again[1], first)
    # ... and a plain denoise after both is bit for bit the one before them: the cancelled
    # batches left nothing behind that changes the next request.
    assert torch.equal(runner.denoise(rows, **ARGS), before)
