"""Latent decoders and the flow-matching scheduler, from diffusers where a real model needs them.

Owns: the FLUX VAE (BAGEL's `ae.safetensors`) as a diffusers `AutoencoderKL` built from an
explicit config (no hub access), its weights converted from the original (LDM) names with
diffusers' own `convert_ldm_vae_checkpoint` and loaded strictly (a missing or unknown tensor is
an error naming it); the pixel decoder of the demo model (its "latents" are the picture itself at
1/downsample resolution); and diffusers' `FlowMatchEulerDiscreteScheduler` set up to give BAGEL's
schedule. Decoders return uint8 RGB [H, W, 3] on CPU. Never owns the DiT or sampling loops.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kvrelay.models.checkpoint import CheckpointError, check_float, scan_tensors
from kvrelay.models.loader import open_safetensors

# FLUX.1's autoencoder (black-forest-labs/flux `AutoEncoderParams`), as diffusers names it:
# 16 latent channels, 8x downsampling, latents scaled by (z - shift) * scale.
FLUX_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
    "force_upcast": True,
}


class Decoder(Protocol):
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [C, h, w] -> uint8 RGB [H, W, 3] on CPU."""
        ...


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """[3, H, W] in [-1, 1] -> uint8 [H, W, 3] on CPU (BAGEL: (x * 0.5 + 0.5).clamp(0, 1) * 255)."""
    rgb = (image.float() * 0.5 + 0.5).clamp(0.0, 1.0) * 255.0
    return rgb.round().to(torch.uint8).permute(1, 2, 0).contiguous().cpu()


def ldm_name(diffusers_key: str, num_up_blocks: int) -> str:
    """The original (LDM / FLUX `ae.safetensors`) name of a diffusers AutoencoderKL tensor: the
    inverse of diffusers' convert_ldm_vae_checkpoint (tests write files with real names with it,
    and loading names a missing tensor in the file's own terms)."""
    k = diffusers_key
    k = re.sub(r"down_blocks\.(\d+)\.resnets\.(\d+)\.", r"down.\1.block.\2.", k)
    k = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", k)
    k = re.sub(
        r"up_blocks\.(\d+)\.resnets\.(\d+)\.",
        lambda m: f"up.{num_up_blocks - 1 - int(m.group(1))}.block.{m.group(2)}.",
        k,
    )
    k = re.sub(
        r"up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"up.{num_up_blocks - 1 - int(m.group(1))}.upsample.", k
    )
    k = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}.", k)
    k = k.replace("mid_block.attentions.0.", "mid.attn_1.")
    k = k.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
    for ours, theirs in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
        k = k.replace(f"attn_1.{ours}.", f"attn_1.{theirs}.")
    return k


def _is_attention_matrix(ldm_key: str) -> bool:
    return bool(re.search(r"attn_1\.(q|k|v|proj_out)\.weight$", ldm_key))


def to_ldm_state(model: torch.nn.Module, num_up_blocks: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL's tensors under their original names and shapes (attention
    projections as 1x1 convolutions), ready for `ae.safetensors`."""
    out = {}
    for key, tensor in model.state_dict().items():
        name = ldm_name(key, num_up_blocks)
        t = tensor.detach().cpu().contiguous()
        if _is_attention_matrix(name):
            t = t[:, :, None, None].contiguous()
        out[name] = t
    return out


def build_autoencoder(config: Mapping[str, Any] | None = None) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(**dict(config or FLUX_VAE_CONFIG))


def load_autoencoder(
    path: str | Path,
    config: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A diffusers AutoencoderKL with the weights of an original-layout `ae.safetensors`."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no VAE weights at {path}")
    cfg = dict(config or FLUX_VAE_CONFIG)
    vae = build_autoencoder(cfg)
    ups = len(cfg["up_block_types"])
    # Headers first: a truncated or corrupt file, or non-float tensors, are named before any read.
    for key, stored in scan_tensors([path]).items():
        check_float(key, stored)
    with open_safetensors(path) as f:
        state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping
    expected = {ldm_name(k, ups): tuple(v.shape) for k, v in vae.state_dict().items()}
    for key in sorted(expected):
        if key not in state:
            raise CheckpointError(f"{path.name} is missing tensor {key!r}")
    for key in sorted(state):
        if key not in expected:
            raise CheckpointError(f"{path.name} has an unexpected tensor {key!r}")
        want = expected[key]
        got = tuple(state[key].shape)
        if got != want and not (_is_attention_matrix(key) and got == (*want, 1, 1)):
            raise CheckpointError(f"{path.name}: tensor {key!r} has shape {got}, the VAE expects {want}")
    converted = convert_ldm_vae_checkpoint(state, cfg)
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path.name}: conversion left missing {missing[:3]} / unexpected {unexpected[:3]}")
    vae = vae.to(device=device)
    if dtype != torch.float32:
        vae = vae.to(dtype=dtype)
    return vae.eval().requires_grad_(False)


class AutoencoderDecoder:
    """Decode with a diffusers AutoencoderKL: z / scaling_factor + shift_factor, then the decoder
    (what BAGEL's FLUX `AutoEncoder.decode` does)."""

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        self.scale = float(vae.config.scaling_factor)
        self.shift = float(vae.config.shift_factor or 0.0)

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        param = next(self.vae.parameters())
        z = latents.to(device=param.device, dtype=param.dtype)[None] / self.scale + self.shift
        image = self.vae.decode(z).sample[0]
        return to_uint8(image)


class PixelDecoder:
    """The demo model's decoder: its latents are RGB in [-1, 1] at 1/downsample of the image
    size; decoding is a bilinear upsample (no weights)."""

    def __init__(self, downsample: int) -> None:
        self.downsample = downsample

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.shape[0] != 3:
            raise ValueError(f"the pixel decoder needs 3 latent channels, got {latents.shape[0]}")
        up = F.interpolate(latents.float()[None], scale_factor=self.downsample, mode="bilinear", align_corners=False)
        return to_uint8(up[0])


def pixel_encode(image: torch.Tensor, downsample: int) -> torch.Tensor:
    """The demo's encoder: uint8 or [0, 1] float RGB [B, 3, H, W] -> [-1, 1] at 1/downsample
    (area average)."""
    x = image.float()
    if image.dtype == torch.uint8:
        x = x / 255.0
    return F.avg_pool2d(x * 2.0 - 1.0, downsample)


def flow_match_scheduler(steps: int, shift: float, device: torch.device | str = "cpu") -> Any:
    """diffusers' FlowMatchEulerDiscreteScheduler on BAGEL's schedule: sigmas
    linspace(1, 0, steps + 1) shifted by `shift` (sigma' = s*sigma / (1 + (s-1)*sigma)), the
    final 0 appended by the scheduler; `step` is x + (sigma_next - sigma) * v."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {steps}")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1].tolist()
    scheduler.set_timesteps(sigmas=sigmas, device=device)
    return scheduler


def build_decoder(
    kind: Mapping[str, Any],
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Decoder:
    """The decoder a model directory declares (`kvrelay.json` "vae"): "flux" (default: the
    directory's ae.safetensors with the FLUX config), "autoencoder_kl" with an explicit "config",
    or "pixel" with a "downsample"."""
    name = kind.get("kind", "flux")
    if name == "pixel":
        return PixelDecoder(int(kind["downsample"]))
    if name in ("flux", "autoencoder_kl"):
        config = FLUX_VAE_CONFIG if name == "flux" else kind["config"]
        file = Path(directory) / str(kind.get("file", "ae.safetensors"))
        return AutoencoderDecoder(load_autoencoder(file, config, device=device, dtype=dtype))
    raise CheckpointError(f"unknown vae kind {name!r} (flux, autoencoder_kl, pixel)")
