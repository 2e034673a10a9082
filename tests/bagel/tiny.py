"""A tiny BAGEL-format checkpoint written at test time: the release's file names and tensor names
(`ema.safetensors`, `llm_config.json`, Qwen2-style special tokens in `tokenizer.json`, an
original-layout `ae.safetensors`), with few layers and small widths, random seeded weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvrelay.models.bagel import (
    BagelAr,
    BagelConfig,
    BagelDit,
    init_random,
    word_tokenizer_json,
    write_bagel_dir,
)
from kvrelay.models.presets import ArConfig
from kvrelay.models.vae import build_autoencoder, to_ldm_state

WORDS = "a red green blue circle square on the background top left right bottom".split()
# 2 down blocks: 2x downsampling, 4 latent channels.
TINY_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [8, 16],
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "layers_per_block": 1,
    "act_fn": "silu",
    "norm_num_groups": 4,
    "sample_size": 32,
    "scaling_factor": 0.5,
    "shift_factor": 0.1,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}


def tiny_config() -> BagelConfig:
    vocab = 1 + len(WORDS) + 4
    llm = ArConfig(
        num_layers=2, hidden=64, num_heads=8, num_kv_heads=4, head_dim=8, mlp=96,
        vocab=vocab, max_tokens=128, rope_theta=10000.0, qkv_bias=True,
    )
    return BagelConfig(
        llm=llm, dtype="float32", latent_channels=4, latent_patch_size=2, vae_downsample=2,
        max_latent_size=8, timestep_shift=3.0, start_of_image=vocab - 2, end_of_image=vocab - 1,
        vae={"kind": "autoencoder_kl", "config": TINY_VAE},
    )


def write_tiny_bagel(directory: Path, seed: int = 0) -> Path:
    cfg = tiny_config()
    ar = BagelAr(cfg, dtype=torch.float32, device="cpu")
    dit = BagelDit(cfg, dtype=torch.float32, device="cpu")
    init_random(ar, seed)
    init_random(dit, seed + 1)
    # One model: the DiT's understanding expert is the AR's (the file holds it once).
    dit_params = dict(dit.named_parameters())
    with torch.no_grad():
        for name, p in ar.named_parameters():
            if name in dit_params:
                dit_params[name].copy_(p)
        dit.marker_embed.copy_(ar.embed_tokens.weight[[cfg.start_of_image, cfg.end_of_image]])
    # Tensors of the release that serving ignores must load without complaint.
    unused = {
        "language_model.lm_head.weight": torch.zeros(cfg.llm.vocab, cfg.llm.hidden),
        "vit_pos_embed.pos_embed": torch.zeros(4, cfg.llm.hidden),
        "connector.fc1.weight": torch.zeros(8, 8),
    }
    write_bagel_dir(
        directory, ar, dit, tokenizer_json=word_tokenizer_json(WORDS),
        kvrelay={"dtype": "float32", "vae": cfg.vae, "sampler": {"timestep_shift": 3.0}},
        extra_tensors=unused,
    )
    vae = build_autoencoder(TINY_VAE)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    from safetensors.torch import save_file

    save_file(to_ldm_state(vae, len(TINY_VAE["up_block_types"])), str(directory / "ae.safetensors"))
    return directory
