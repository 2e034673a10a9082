#!/usr/bin/env python3
"""Memory and time of BAGEL-7B-MoT on one GPU, measured with the shapes of the release (random
weights: no download). Builds the AR (understanding expert) and the DiT (both experts: the
image markers go through the understanding expert) exactly as `format: bagel` does, plus the
FLUX VAE (diffusers AutoencoderKL, FLUX config), then times a prefill, denoising steps with CFG
and a decode, and reports weights and peak memory per stage.

    python benchmarks/bagel_7b_memory.py --device cuda --size 1024 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrelay.models.bagel import BagelAr, BagelConfig, BagelDit  # noqa: E402
from kvrelay.models.presets import ArConfig  # noqa: E402
from kvrelay.models.vae import AutoencoderDecoder, build_autoencoder  # noqa: E402

# BAGEL-7B-MoT's llm_config.json (Qwen2.5-7B) and latent settings.
QWEN2_7B = ArConfig(
    num_layers=28, hidden=3584, num_heads=28, num_kv_heads=4, head_dim=128, mlp=18944,
    vocab=152064, max_tokens=32768, rope_theta=1000000.0, qkv_bias=True,
)


def fill(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("pos_embed"):
                continue
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.02)


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=4, help="timed denoising steps (CFG: 2 rows)")
    args = parser.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    cfg = BagelConfig(llm=QWEN2_7B)
    out: dict[str, object] = {"device": torch.cuda.get_device_name(dev), "size": args.size, "prompt_tokens": args.tokens}

    def sync() -> None:
        torch.cuda.synchronize(dev)

    torch.cuda.reset_peak_memory_stats(dev)
    ar = BagelAr(cfg, dtype=dtype, device=dev).eval()
    fill(ar)
    ar_weights = sum(p.numel() * p.element_size() for p in ar.parameters())
    ids = list(range(100, 100 + args.tokens))
    ar.prefill(ids)
    sync()
    t0 = time.perf_counter()
    kv = ar.prefill(ids)
    sync()
    out["ar"] = {"weights_gib": gib(ar_weights), "params_b": round(ar_weights / 2 / 1e9, 2),
                 "peak_gib": gib(torch.cuda.max_memory_allocated(dev)), "prefill_s": round(time.perf_counter() - t0, 4),
                 "kv_bytes_per_token": kv[..., :1, :].numel() * 2}
    uncond = ar.prefill([151644, 151645])
    del ar
    torch.cuda.empty_cache()

    torch.cuda.reset_peak_memory_stats(dev)
    dit = BagelDit(cfg, dtype=dtype, device=dev).eval()
    fill(dit)
    dit_weights = sum(p.numel() * p.element_size() for p in dit.parameters())
    grid = args.size // cfg.latent_downsample
    n = grid * grid
    pos = dit.position_ids(grid, grid)
    rows = [[(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])], [(uncond[i, 0], uncond[i, 1]) for i in range(uncond.shape[0])]]
    x = torch.randn(2, n, cfg.patch_dim, device=dev, dtype=dtype)
    t = torch.full((2,), 0.5, device=dev)
    with torch.no_grad():
        dit(x, t, pos, rows, [args.tokens, 2])
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            dit(x, t, pos, rows, [args.tokens, 2])
        sync()
    step_s = (time.perf_counter() - t0) / args.steps
    out["dit"] = {"weights_gib": gib(dit_weights), "params_b": round(dit_weights / 2 / 1e9, 2),
                  "peak_gib": gib(torch.cuda.max_memory_allocated(dev)), "image_tokens": n,
                  "cfg_step_s": round(step_s, 4), "50_steps_s": round(step_s * 49, 2)}
    del dit, rows, kv, uncond
    torch.cuda.empty_cache()

    try:
        import diffusers  # noqa: F401
    except ImportError:
        out["vae"] = "diffusers not installed here: not measured"
        print(json.dumps(out))
        return
    torch.cuda.reset_peak_memory_stats(dev)
    vae = build_autoencoder().to(device=dev, dtype=dtype).eval().requires_grad_(False)
    decoder = AutoencoderDecoder(vae)
    z = torch.randn(16, args.size // 8, args.size // 8, device=dev)
    decoder(z)
    sync()
    t0 = time.perf_counter()
    decoder(z)
    sync()
    out["vae"] = {"weights_gib": gib(sum(p.numel() * p.element_size() for p in vae.parameters())),
                  "peak_gib": gib(torch.cuda.max_memory_allocated(dev)), "decode_s": round(time.perf_counter() - t0, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
