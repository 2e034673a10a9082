"""The built-in demo model's world: procedurally drawn pictures and their captions.

One shape (circle, square, triangle) of one colour on a plain background of another colour, in
one of five places, captioned "a red circle on a blue background, top left". The demo model
(a tiny BAGEL, committed in kvrelay/models/demo/, trained by scripts/train_demo.py) learns to
draw these; its "latents" are the picture itself at 1/16 of the image size (a 512x512 picture is
32x32x3, cut into 4x4 patches: 64 tokens), decoded by a bilinear upsample. Pure torch, no I/O.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from kvrelay.models.bagel_config import BagelConfig
from kvrelay.models.presets import ArConfig

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "purple": (140, 40, 180),
    "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle")
# Shape centres as fractions of the picture (x, y).
PLACES: dict[str, tuple[float, float]] = {
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.5, 0.5),
}
WORDS = ["a", "on", "background", ",", *COLOURS, *SHAPES, "top", "bottom", "left", "right", "center"]
LATENT = 32  # latent pixels per side at 512x512
DOWNSAMPLE = 16
PATCH = 4


def caption(colour: str, shape: str, bg: str, place: str) -> str:
    return f"a {colour} {shape} on a {bg} background, {place}"


def render(colour: str, shape: str, bg: str, place: str, size: int = LATENT, rng: random.Random | None = None) -> torch.Tensor:
    """[3, size, size] in [-1, 1]: drawn at 2x and area-averaged (soft edges)."""
    rng = rng or random.Random(0)
    s = size * 2
    cx, cy = PLACES[place]
    cx = (cx + rng.uniform(-0.04, 0.04)) * s
    cy = (cy + rng.uniform(-0.04, 0.04)) * s
    r = rng.uniform(0.15, 0.2) * s
    ys, xs = torch.meshgrid(torch.arange(s) + 0.5, torch.arange(s) + 0.5, indexing="ij")
    if shape == "circle":
        mask = (xs - cx) ** 2 + (ys - cy) ** 2 <= r * r
    elif shape == "square":
        mask = ((xs - cx).abs() <= r * 0.9) & ((ys - cy).abs() <= r * 0.9)
    else:  # triangle, apex up
        top, bottom = cy - r, cy + r
        half = (ys - top) / (2 * r) * r * 1.1
        mask = (ys >= top) & (ys <= bottom) & ((xs - cx).abs() <= half)
    fg = torch.tensor(COLOURS[colour], dtype=torch.float32)[:, None, None]
    back = torch.tensor(COLOURS[bg], dtype=torch.float32)[:, None, None]
    img = torch.where(mask[None], fg, back)
    img = F.avg_pool2d(img[None], 2)[0]
    return img / 127.5 - 1.0


def sample(rng: random.Random) -> tuple[str, torch.Tensor]:
    colour, bg = rng.sample(list(COLOURS), 2)
    shape, place = rng.choice(SHAPES), rng.choice(list(PLACES))
    return caption(colour, shape, bg, place), render(colour, shape, bg, place, rng=rng)


def demo_config() -> BagelConfig:
    vocab = 1 + len(WORDS) + 4  # <unk>, words, BAGEL's 4 specials (see word_tokenizer_json)
    llm = ArConfig(
        num_layers=4, hidden=128, num_heads=8, num_kv_heads=4, head_dim=16, mlp=256,
        vocab=vocab, max_tokens=64, rope_theta=10000.0, qkv_bias=True,
    )
    return BagelConfig(
        llm=llm, dtype="float32", latent_channels=3, latent_patch_size=PATCH, vae_downsample=DOWNSAMPLE,
        max_latent_size=16, timestep_shift=1.0, cfg_interval=(0.0, 1.0),
        start_of_image=vocab - 2, end_of_image=vocab - 1,
        vae={"kind": "pixel", "downsample": DOWNSAMPLE},
    )


def nearest_colour(rgb: tuple[float, float, float] | torch.Tensor) -> str:
    """The palette colour closest (Euclidean RGB) to `rgb`."""
    r, g, b = (float(c) for c in rgb)
    return min(COLOURS, key=lambda n: sum((x - y) ** 2 for x, y in zip((r, g, b), COLOURS[n], strict=True)))
