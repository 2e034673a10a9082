"""The diffusers parts: AutoencoderKL from an explicit config with original-layout weights, and
FlowMatchEulerDiscreteScheduler giving BAGEL's schedule and update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.models.loader import CheckpointError
from kvrelay.models.vae import (
    FLUX_VAE_CONFIG,
    AutoencoderDecoder,
    PixelDecoder,
    build_autoencoder,
    flow_match_scheduler,
    ldm_name,
    load_autoencoder,
    pixel_encode,
    to_ldm_state,
)

from .tiny import TINY_VAE


@pytest.fixture(scope="module")
def ae_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    vae = build_autoencoder(TINY_VAE)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    path = tmp_path_factory.mktemp("vae") / "ae.safetensors"
    save_file(to_ldm_state(vae, 2), str(path))
    return path, vae


def test_the_file_has_the_original_names(ae_file: tuple[Path, torch.nn.Module]) -> None:
    names = set(load_file(str(ae_file[0])))
    for key in (
        "decoder.conv_in.weight", "decoder.mid.attn_1.q.weight", "decoder.mid.block_2.norm1.bias",
        "decoder.up.1.block.0.conv1.weight", "decoder.up.1.upsample.conv.weight",
        "decoder.up.0.block.0.nin_shortcut.weight", "decoder.norm_out.weight", "encoder.down.0.downsample.conv.weight",
    ):
        assert key in names, key
    assert load_file(str(ae_file[0]))["decoder.mid.attn_1.q.weight"].dim() == 4  # 1x1 conv, as the release


def test_diffusers_conversion_restores_every_tensor(ae_file: tuple[Path, torch.nn.Module]) -> None:
    path, original = ae_file
    loaded = load_autoencoder(path, TINY_VAE)
    want = original.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_decode_is_bagels(ae_file: tuple[Path, torch.nn.Module]) -> None:
    path, original = ae_file
    decoder = AutoencoderDecoder(load_autoencoder(path, TINY_VAE))
    z = torch.randn(4, 4, 6, generator=torch.Generator().manual_seed(1))
    image = decoder(z)
    with torch.no_grad():
        ref = original.decode((z / 0.5 + 0.1)[None]).sample[0]
    ref = ((ref * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
    assert image.shape == (8, 12, 3)
    assert torch.equal(image, ref)


def test_missing_or_unknown_vae_tensor_is_named(ae_file: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    state = load_file(str(ae_file[0]))
    state["decoder.up.0.block.0.conv9.weight"] = state.pop("decoder.up.0.block.0.conv1.weight")
    bad = tmp_path / "ae.safetensors"
    save_file(state, str(bad))
    with pytest.raises(CheckpointError, match="missing tensor 'decoder.up.0.block.0.conv1.weight'"):
        load_autoencoder(bad, TINY_VAE)
    state["decoder.up.0.block.0.conv1.weight"] = state.pop("decoder.up.0.block.0.conv9.weight")
    state["decoder.extra.weight"] = torch.zeros(1)
    save_file(state, str(bad))
    with pytest.raises(CheckpointError, match="unexpected tensor 'decoder.extra.weight'"):
        load_autoencoder(bad, TINY_VAE)


def test_flux_config_names_the_real_layout() -> None:
    # 4 levels of 2 resnets: the FLUX ae.safetensors names (checked without building the 84M model)
    assert ldm_name("decoder.up_blocks.0.resnets.2.conv1.weight", 4) == "decoder.up.3.block.2.conv1.weight"
    assert ldm_name("decoder.up_blocks.3.upsamplers.0.conv.weight", 4) == "decoder.up.0.upsample.conv.weight"
    assert ldm_name("encoder.mid_block.attentions.0.to_out.0.weight", 4) == "encoder.mid.attn_1.proj_out.weight"
    assert ldm_name("encoder.conv_norm_out.bias", 4) == "encoder.norm_out.bias"
    assert FLUX_VAE_CONFIG["latent_channels"] == 16 and len(FLUX_VAE_CONFIG["block_out_channels"]) == 4


@pytest.mark.parametrize("steps, shift", [(1, 1.0), (4, 3.0), (49, 3.0)])
def test_scheduler_is_bagels_schedule(steps: int, shift: float) -> None:
    sched = flow_match_scheduler(steps, shift)
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    t = shift * t / (1 + (shift - 1) * t)  # Bagel.generate_image
    assert len(sched.timesteps) == steps
    torch.testing.assert_close(sched.sigmas.double(), t, atol=1e-6, rtol=0)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    for i, timestep in enumerate(sched.timesteps):
        v = torch.randn(5, 3, generator=torch.Generator().manual_seed(i + 1))
        want = x - v * float(t[i] - t[i + 1])  # x_t - v_t * dt
        x = sched.step(v, timestep, x, return_dict=False)[0]
        torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)


def test_pixel_decoder_round_trips_flat_colours() -> None:
    img = torch.zeros(1, 3, 64, 64, dtype=torch.uint8)
    img[:, 0] = 200
    img[:, 2, :, 32:] = 100
    lat = pixel_encode(img, 16)[0]
    assert lat.shape == (3, 4, 4)
    out = PixelDecoder(16)(lat)
    assert out.shape == (64, 64, 3)
    assert int(out[10, 10, 0]) == 200 and int(out[10, 10, 2]) == 0 and int(out[10, 60, 2]) == 100
