"""The flow-matching Euler sampler: schedule, seeded noise, CFG rows and combination, callbacks."""

from __future__ import annotations

import pytest
import torch

from kvrelay.models.sampler import cfg_rows, combine_cfg, euler_sample, flow_timesteps, initial_noise


def test_schedule_runs_from_noise_to_data() -> None:
    t = flow_timesteps(4)
    assert t.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    shifted = flow_timesteps(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0
    assert bool((shifted[1:-1] > t[1:-1]).all())  # shift spends more steps near the noise end
    with pytest.raises(ValueError):
        flow_timesteps(0)


def test_cfg_rows() -> None:
    assert cfg_rows(1.0) == 1
    assert cfg_rows(2.0) == 2
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            cfg_rows(bad)


def test_initial_noise_is_a_function_of_the_seed_only() -> None:
    torch.manual_seed(123)  # the global RNG must not matter
    a = initial_noise(7, (4, 8, 8), dtype=torch.float32)
    torch.manual_seed(456)
    b = initial_noise(7, (4, 8, 8), dtype=torch.float32)
    assert torch.equal(a, b)
    assert not torch.equal(a, initial_noise(8, (4, 8, 8), dtype=torch.float32))
    assert torch.equal(initial_noise(7, (4, 8, 8), dtype=torch.bfloat16), a.to(torch.bfloat16))


@pytest.mark.parametrize("steps", [1, 2, 7])
def test_an_exact_velocity_reaches_the_data(steps: int) -> None:
    """With the ideal velocity of a point mass at x0, v(x, t) = (x - x0) / t, Euler lands on x0:
    checks the sign and time conventions (t from 1 to 0, x <- x + (t_next - t) v)."""
    x0 = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    noise = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
        return (x - x0) / t

    out = euler_sample(velocity, noise, steps=steps, guidance_scale=1.0)
    torch.testing.assert_close(out, x0, atol=1e-6, rtol=1e-6)


def test_guidance_batches_rows_and_combines_them() -> None:
    calls: list[int] = []

    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
        calls.append(x.shape[0])
        # row 0 (prompt) pushes +1, row 1 (negative) pushes -1
        return torch.stack([torch.ones_like(x[0]), -torch.ones_like(x[0])])[: x.shape[0]]

    noise = torch.zeros(2, 2, 2)
    out = euler_sample(velocity, noise, steps=2, guidance_scale=3.0)
    assert calls == [2, 2]
    # guided v = -1 + 3 * (1 - (-1)) = 5; x = 0 + (0 - 1) * 5
    torch.testing.assert_close(out, torch.full((2, 2, 2), -5.0))

    calls.clear()
    out = euler_sample(velocity, noise, steps=3, guidance_scale=1.0)
    assert calls == [1, 1, 1]  # guidance 1.0: one row, no negative prompt evaluated
    torch.testing.assert_close(out, torch.full((2, 2, 2), -1.0))


def test_combine_cfg_rejects_more_rows() -> None:
    with pytest.raises(ValueError):
        combine_cfg(torch.zeros(3, 1), 2.0)


def test_callback_reports_every_step_and_can_stop() -> None:
    evaluated: list[float] = []

    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
        assert type(t) is float  # the step's flow time stays on the host, shared by every row
        evaluated.append(t)
        return torch.zeros_like(x)

    seen: list[tuple[int, int]] = []
    euler_sample(
        velocity, torch.zeros(1, 2, 2), steps=4, guidance_scale=1.0, on_step=lambda k, n: seen.append((k, n))
    )
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert evaluated == flow_timesteps(4).tolist()[:4]  # the exact fp64 schedule values

    class Cancelled(Exception):
        pass

    def stop_at_two(k: int, n: int) -> None:
        if k == 2:
            raise Cancelled

    evaluated.clear()
    with pytest.raises(Cancelled):
        euler_sample(velocity, torch.zeros(1, 2, 2), steps=10, guidance_scale=1.0, on_step=stop_at_two)
    assert len(evaluated) == 2  # stopped within one step of the request
