"""Flow-matching Euler sampler with classifier-free guidance over batched CFG rows.

Owns the denoising loop's arithmetic only: the noise schedule, the seeded initial noise, the Euler
update and the CFG combination. It knows nothing of pages, ranks or weights; the velocity model is
a callable, so the same loop drives one process or every rank of a TP/SP group (each rank runs the
identical loop on replicated latents). It must never swallow an exception from the step callback:
raising there is how a caller cancels mid-denoise.

Convention (rectified flow, as SD3/BAGEL): ``x_t = (1 - t) * x_0 + t * noise`` with ``t`` from 1
(pure noise) to 0 (data); the model predicts the velocity ``v = noise - x_0``; an Euler step is
``x <- x + (t_next - t) * v``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# velocity(x [rows, C, h, w], t) -> v [rows, C, h, w]; row 0 = prompt, row 1 = negative. t is the
# step's flow time as a host float, shared by every row (the model conditions on it once per step).
VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]
# on_step(step, total) after step `step` (1-based) is applied; raising stops the loop there.
StepCallback = Callable[[int, int], None]


def cfg_rows(guidance_scale: float) -> int:
    """Rows a request needs: 2 (prompt + negative) with guidance, 1 when ``guidance_scale == 1``."""
    if not (guidance_scale >= 1.0) or guidance_scale == float("inf"):
        raise ValueError(f"guidance_scale must be finite and >= 1.0, got {guidance_scale}")
    return 1 if guidance_scale == 1.0 else 2


def flow_timesteps(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` times from 1.0 down to 0.0 (fp64 on CPU, so every rank and device agrees).

    ``shift > 1`` spends more of the budget near the noise end (SD3's resolution shift:
    ``t' = shift * t / (1 + (shift - 1) * t)``); 1.0 is the plain linear schedule.
    """
    if steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {steps}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    if shift != 1.0:
        t = shift * t / (1.0 + (shift - 1.0) * t)
    return t


def initial_noise(
    seed: int, shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Gaussian latents from ``seed``, identical across processes, TP/SP sizes and devices.

    Drawn on CPU in fp32 from a private generator and only then moved and cast: CUDA and CPU
    generators give different streams, and the global RNG would make results depend on what ran
    before.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    return noise.to(device=device, dtype=dtype)


def combine_cfg(velocity: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance over the batched rows: ``v_neg + g * (v_prompt - v_neg)``."""
    if velocity.shape[0] == 1:
        return velocity[0]
    if velocity.shape[0] != 2:
        raise ValueError(f"expected 1 or 2 CFG rows, got {velocity.shape[0]}")
    cond, uncond = velocity[0], velocity[1]
    return uncond + guidance_scale * (cond - uncond)


@torch.no_grad()
def euler_sample(
    velocity_fn: VelocityFn,
    noise: torch.Tensor,
    *,
    steps: int,
    guidance_scale: float,
    shift: float = 1.0,
    on_step: StepCallback | None = None,
) -> torch.Tensor:
    """Denoise ``noise`` ``[C, h, w]`` in ``steps`` Euler steps; returns latents ``[C, h, w]``.

    Every step evaluates all CFG rows in one batched call (the rows share the latents and differ
    only in the prefix they attend to), then applies the guided velocity. ``on_step(k, steps)``
    runs after step ``k`` is applied, so a callback that raises stops at most one step late.
    """
    rows = cfg_rows(guidance_scale)
    times = flow_timesteps(steps, shift)
    x = noise
    for k in range(steps):
        t, t_next = float(times[k]), float(times[k + 1])
        batch = x.unsqueeze(0).expand(rows, *x.shape)
        v = combine_cfg(velocity_fn(batch, t), guidance_scale)
        # Accumulate in fp32: with bf16 latents and few steps the update would otherwise round
        # differently per device, and the extra precision costs nothing at latent size.
        x = (x.float() + (t_next - t) * v.float()).to(noise.dtype)
        if on_step is not None:
            on_step(k + 1, steps)
    return x
