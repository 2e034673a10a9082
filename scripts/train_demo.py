#!/usr/bin/env python3
"""Train the built-in demo model: a tiny BAGEL (MoT: understanding expert = AR, generation
expert = DiT) that draws what it is told, on procedurally generated pictures and captions.

    python scripts/train_demo.py --out kvrelay/models/demo --minutes 15

Pictures: one shape (circle, square, triangle) of one colour on a plain background of another,
in one of five places; caption "a red circle on a blue background, top left". The model works
in pixel space at 1/16 of the image size (a 512x512 picture is a 32x32x3 "latent", 4x4 patches,
64 tokens) and the demo's decoder upsamples bilinearly (kvrelay.models.vae.PixelDecoder), so it
trains in minutes on one CPU core. Training is BAGEL's: the prompt runs causally through the
understanding expert, the noised latent tokens through the generation expert over that KV
prefix (markers, one RoPE position, sin-cos latent positions, timestep embedding), flow
matching with logit-normal times, the caption dropped 10% of the time for CFG. Writes the
release layout (ema.safetensors, llm_config.json, tokenizer.json, kvrelay.json), so the demo
loads through the same code as BAGEL-7B-MoT (`model: {format: demo}`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvrelay.models.bagel import BagelAr, BagelDit, word_tokenizer_json, write_bagel_dir  # noqa: E402
from kvrelay.models.demo import LATENT, PATCH, WORDS, demo_config, sample  # noqa: E402


def init_weights(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("pos_embed"):
                continue
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        # BAGEL zero-initializes llm2vae: training starts from a zero velocity.
        if hasattr(module, "llm2vae"):
            module.llm2vae.weight.zero_()
            module.llm2vae.bias.zero_()


def tie_understanding(ar: BagelAr, dit: BagelDit) -> None:
    """One model: the DiT's understanding expert (used for the image markers) is the AR's."""
    for a, d in zip(ar.layers, dit.layers, strict=True):
        d.input_layernorm, d.post_attention_layernorm, d.mlp = a.input_layernorm, a.post_attention_layernorm, a.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            setattr(d.self_attn, name, getattr(a.self_attn, name))


def patchify(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(b, (h // PATCH) * (w // PATCH), PATCH * PATCH * c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="kvrelay/models/demo")
    parser.add_argument("--minutes", type=float, default=13.0, help="training budget in CPU minutes of this process")
    parser.add_argument("--wall-minutes", type=float, default=35.0, help="wall-clock cap (a busy machine)")
    parser.add_argument("--max-steps", type=int, default=100000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", default=None, help="continue from a demo directory written by this script")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = demo_config()
    from tokenizers import Tokenizer

    tok_json = word_tokenizer_json(WORDS)
    tok = Tokenizer.from_str(tok_json)
    bos, eos = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ar = BagelAr(cfg, dtype=torch.float32, device="cpu")
    dit = BagelDit(cfg, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(args.seed)
    init_weights(ar, gen)
    init_weights(dit, gen)
    with torch.no_grad():
        ar.embed_tokens.weight.normal_(0.0, 1.0, generator=gen)
        dit.marker_embed.normal_(0.0, 1.0, generator=gen)
    tie_understanding(ar, dit)
    if args.init:
        from kvrelay.models.bagel import load_ar, load_dit

        load_ar(args.init, cfg, ar)
        load_dit(args.init, cfg, dit)
    params = {id(p): p for m in (ar, dit) for n, p in m.named_parameters() if not n.endswith("pos_embed")}
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(list(params.values()), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
    pos = dit.position_ids(LATENT // PATCH, LATENT // PATCH)
    budget = args.minutes * 60.0
    start, cpu0 = time.time(), time.process_time()
    step, ema_loss = 0, None
    warmup = 0 if args.init else 50

    def progress() -> float:
        return max((time.process_time() - cpu0) / budget, (time.time() - start) / (args.wall_minutes * 60.0))

    while step < args.max_steps and progress() < 1.0:
        texts, images = zip(*(sample(rng) for _ in range(args.batch)), strict=True)
        texts = tuple("" if rng.random() < 0.1 else t for t in texts)
        seqs = [[bos, *tok.encode(t, add_special_tokens=False).ids, eos] for t in texts]
        lens = torch.tensor([len(s) for s in seqs])
        t_max = int(lens.max())
        ids = torch.tensor([s + [eos] * (t_max - len(s)) for s in seqs])
        x0 = patchify(torch.stack(images))
        t = torch.sigmoid(torch.randn(args.batch))
        noise = torch.randn_like(x0)
        x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        kv = ar.prefix_kv(ids)
        v = dit(x_t, t, pos, None, lens, padded_prefix=kv)
        loss = F.mse_loss(v, noise - x0)
        frac = min(1.0, progress())
        lr = args.lr * min(1.0, (step + 1) / max(1, warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        ema_loss = value if ema_loss is None else 0.98 * ema_loss + 0.02 * value
        if step % 50 == 0:
            print(json.dumps({"step": step, "loss": round(ema_loss, 4), "lr": round(lr, 6),
                              "elapsed_s": round(time.time() - start, 1),
                              "cpu_s": round(time.process_time() - cpu0, 1)}), flush=True)
    for p in params.values():
        p.requires_grad_(False)
    out = write_bagel_dir(
        args.out, ar, dit, tokenizer_json=tok_json,
        kvrelay={
            "dtype": "float32",
            "latent_patch_size": PATCH,
            "max_latent_size": cfg.max_latent_size,
            "vae": cfg.vae,
            "sampler": {"timestep_shift": cfg.timestep_shift, "cfg_interval": list(cfg.cfg_interval),
                        "cfg_renorm_type": "global", "cfg_renorm_min": 0.0},
            "trained": {"steps": step, "batch": args.batch, "wall_s": round(time.time() - start),
                        "cpu_s": round(time.process_time() - cpu0),
                        "final_loss": round(ema_loss or 0.0, 4), "script": "scripts/train_demo.py"},
        },
    )
    print(json.dumps({"done": True, "steps": step, "loss": ema_loss, "out": str(out)}), flush=True)


if __name__ == "__main__":
    main()
