"""The bundled demo model draws what it is told: colour, background and place of the shape,
judged with image statistics (in process: AR prefill -> pages' KV -> DiT -> decoder)."""

from __future__ import annotations

import random

import pytest
import torch

from kvrelay.models.bagel import build_ar, load_bagel_config
from kvrelay.models.bagel_runner import BagelDitRunner
from kvrelay.models.demo import COLOURS, PLACES, SHAPES, caption
from kvrelay.models.formats import DEMO_DIR
from kvrelay.models.tokenizer import BagelTokenizer

from .demo_judge import judge


@pytest.fixture(scope="module")
def demo() -> tuple[object, BagelTokenizer, BagelDitRunner]:
    return build_ar(DEMO_DIR), BagelTokenizer(DEMO_DIR), BagelDitRunner(DEMO_DIR)


def _rows(ar: object, tok: BagelTokenizer, texts: list[str]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    rows = []
    for text in texts:
        kv = ar.prefill(tok.encode(text))  # type: ignore[attr-defined]
        rows.append([(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])])
    return rows


def test_demo_ships_small_in_the_release_layout() -> None:
    files = {p.name: p.stat().st_size for p in DEMO_DIR.iterdir()}
    assert set(files) == {"ema.safetensors", "llm_config.json", "tokenizer.json", "kvrelay.json"}
    assert sum(files.values()) < 8 << 20
    cfg = load_bagel_config(DEMO_DIR)
    assert (cfg.latent_channels, cfg.latent_patch_size, cfg.vae_downsample) == (3, 4, 16)
    assert cfg.grid(512, 512) == (8, 8)


def test_draws_the_colour_background_and_place_asked_for(
    demo: tuple[object, BagelTokenizer, BagelDitRunner],
) -> None:
    ar, tok, runner = demo
    rng = random.Random(2024)
    verdicts = []
    for i in range(12):
        colour, bg = rng.sample(list(COLOURS), 2)
        shape, place = rng.choice(SHAPES), rng.choice(list(PLACES))
        rows = _rows(ar, tok, [caption(colour, shape, bg, place), ""])
        image = runner.decode(runner.denoise(rows, width=512, height=512, steps=8, guidance_scale=3.0, seed=i))
        verdicts.append((caption(colour, shape, bg, place), judge(image.numpy(), colour, bg, place)))
    wrong = [(text, v) for text, v in verdicts if not v.ok]
    # A model that ignored the prompt would be right about 1 time in 8 x 7 x 5.
    assert len(wrong) <= 1, wrong


def test_a_corrupted_prefix_draws_something_else(demo: tuple[object, BagelTokenizer, BagelDitRunner]) -> None:
    """What the end-to-end test relies on: a prefix whose bytes went wrong in transit (here: V of
    the prompt's tokens swapped with another prompt's) no longer draws what was asked."""
    ar, tok, runner = demo
    text = caption("red", "circle", "blue", "top left")
    good = _rows(ar, tok, [text, ""])
    other = _rows(ar, tok, [caption("yellow", "square", "black", "bottom right")])[0]
    bad = [[(k, other[layer][1][:, : k.shape[1]]) for layer, (k, _) in enumerate(good[0])], good[1]]
    img_good = runner.decode(runner.denoise(good, width=512, height=512, steps=8, guidance_scale=3.0, seed=1))
    img_bad = runner.decode(runner.denoise(bad, width=512, height=512, steps=8, guidance_scale=3.0, seed=1))
    assert judge(img_good.numpy(), "red", "blue", "top left").ok
    assert not judge(img_bad.numpy(), "red", "blue", "top left").ok
