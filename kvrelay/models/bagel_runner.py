"""The DiT runner of BAGEL-format checkpoints (`model: {format: bagel | demo, path: DIR}`).

Owns BAGEL's sampling recipe around kvrelay.models.bagel.BagelDit: seeded packed noise
[n, p*p*C], diffusers' FlowMatchEulerDiscreteScheduler on BAGEL's shifted schedule
(`timestep_shift`, 3.0 for BAGEL-7B-MoT), text CFG only inside `cfg_interval` with BAGEL's
"global" renormalization (the guided velocity is scaled down to the conditional one's norm),
unpatchifying (BAGEL's `nhwpqc -> nchpwq`) and decoding with the directory's VAE (FLUX
AutoencoderKL through diffusers, or the demo's pixel decoder). Same interface as DitRunner, so
the DiT service's rank workers run either. Rank mapping and page layout are DitParallel's.
`quantization="fp8"` runs the generation expert's big linears as FP8 GEMMs (kvrelay.models.fp8).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvrelay.models.bagel import BagelDit, load_dit, precheck
from kvrelay.models.bagel_config import BagelConfig, load_bagel_config
from kvrelay.models.dit import (
    BatchRequest,
    BatchStepCallback,
    DitParallel,
    PrefixRow,
    agreed_step_callback,
    agreed_stop_set,
)
from kvrelay.models.fp8 import check_quantization
from kvrelay.models.layers import torch_dtype
from kvrelay.models.presets import ModelPreset
from kvrelay.models.sampler import StepCallback, cfg_rows, initial_noise
from kvrelay.models.vae import Decoder, build_decoder, flow_match_scheduler
from kvrelay.transfer.layout import PageLayout


def guided_velocity(
    v_cond: torch.Tensor,
    v_uncond: torch.Tensor,
    scale: float,
    *,
    renorm_type: str = "global",
    renorm_min: float = 0.0,
) -> torch.Tensor:
    """BAGEL's text CFG: v_u + s * (v_c - v_u), rescaled so its norm never exceeds v_c's
    ("global": one norm over all tokens and channels; "channel": per token); "none" skips it."""
    guided = v_uncond + scale * (v_cond - v_uncond)
    if renorm_type == "none":
        return guided
    if renorm_type == "global":
        norm_c, norm_g = torch.norm(v_cond.float()), torch.norm(guided.float())
    elif renorm_type == "channel":
        norm_c = torch.norm(v_cond.float(), dim=-1, keepdim=True)
        norm_g = torch.norm(guided.float(), dim=-1, keepdim=True)
    else:
        raise ValueError(f"cfg_renorm_type {renorm_type!r} is not one of global, channel, none")
    factor = (norm_c / (norm_g + 1e-8)).clamp(min=renorm_min, max=1.0)
    return (guided.float() * factor).to(guided.dtype)


class BagelDitRunner:
    """One rank's BAGEL DiT: weights from a BAGEL-format directory, sharded over TP (heads) and
    SP (Ulysses); `denoise` over the CFG rows' prefixes, `decode` to RGB."""

    def __init__(
        self,
        directory: str | Path,
        *,
        rank: int = 0,
        world: int = 1,
        tp: int = 1,
        sp: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        config: BagelConfig | None = None,
        quantization: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.bagel = config or load_bagel_config(self.directory)
        self.preset: ModelPreset = self.bagel.preset()
        self.cfg = self.preset.dit
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch_dtype(self.bagel.dtype))
        # "fp8": the generation expert's q/k/v, o, gate/up and down linears run as FP8 GEMMs
        # (BagelDit.quantize_generation_fp8_); checked before any weight is read.
        self.quantization = quantization
        check_quantization(quantization, self.device, self.dtype)
        self.parallel = DitParallel.build(rank, world, tp, sp)
        precheck(self.directory, self.bagel, dit=True, tp=self.parallel.tp)  # before allocating
        self.model = BagelDit(
            self.bagel, self.parallel.tp, self.parallel.sp, dtype=self.dtype, device=self.device
        ).eval()
        load_dit(self.directory, self.bagel, self.model)
        if quantization is not None:
            self.model.quantize_generation_fp8_()  # frees the quantized linears' bf16 weights
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        # The VAE runs in fp32 on CPU and in the model dtype on GPUs (BAGEL decodes in bf16).
        vae_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.decoder: Decoder | None = None
        if self.parallel.rank == 0:  # only rank 0 decodes (the service encodes rank 0's PNG)
            self.decoder = build_decoder(self.bagel.vae, self.directory, device=self.device, dtype=vae_dtype)

    @property
    def heads_local(self) -> int:
        return self.preset.num_kv_heads // self.parallel.world

    def page_layout(self, page_size: int) -> PageLayout:
        return self.parallel.page_layout(self.preset, page_size)

    def _check_prefix(self, prefix_rows: Sequence[PrefixRow], guidance_scale: float) -> None:
        rows = cfg_rows(guidance_scale)
        if len(prefix_rows) != rows:
            raise ValueError(f"guidance_scale={guidance_scale} needs {rows} CFG row(s), got {len(prefix_rows)}")
        want = (self.heads_local, self.preset.head_dim)
        for r, row in enumerate(prefix_rows):
            if len(row) != self.preset.num_layers:
                raise ValueError(f"row {r}: prefix has {len(row)} layers, the model {self.preset.num_layers}")
            for layer, (k, v) in enumerate(row):
                if k.dim() != 3 or (k.shape[0], k.shape[2]) != want or k.shape != v.shape:
                    raise ValueError(f"row {r} layer {layer}: prefix k/v {tuple(k.shape)} must be [{want[0]}, T, {want[1]}]")

    def _agreed(self, on_step: StepCallback | None) -> StepCallback | None:
        """All ranks stop after the same step, as DitRunner."""
        return agreed_step_callback(on_step, self.parallel.rank, self.parallel.world, self.device)

    def warm_up(self, width: int = 512, height: int = 512) -> None:
        """Before SERVING: import diffusers' scheduler now (seconds on a busy CPU) rather than in
        the first request. Nothing is compiled or captured."""
        flow_match_scheduler(1, self.bagel.timestep_shift)

    @torch.no_grad()
    def denoise(
        self,
        prefix_rows: Sequence[PrefixRow],
        *,
        width: int,
        height: int,
        steps: int,
        guidance_scale: float,
        seed: int,
        on_step: StepCallback | None = None,
    ) -> torch.Tensor:
        """Latents [C, height/vae_downsample, width/vae_downsample] after `steps` Euler steps.
        `on_step(k, steps)` runs after each step; raising there stops every rank after it."""
        callback = self._agreed(on_step)

        def batch_step(k: int, total: int, active: list[int]) -> set[int]:
            if callback is not None:
                callback(k, total)
            return set()

        out = self._sample([BatchRequest(prefix_rows, guidance_scale, seed)], width, height, steps, batch_step)
        assert out[0] is not None
        return out[0]

    @torch.no_grad()
    def denoise_batch(
        self,
        requests: Sequence[BatchRequest],
        *,
        width: int,
        height: int,
        steps: int,
        on_step: BatchStepCallback | None = None,
    ) -> list[torch.Tensor | None]:
        """Several requests of one size and step count: every step is one forward over all their
        CFG rows (each row attends to its own prefix). `on_step(k, steps, active)` returns the
        requests to stop now (None in the result); ranks agree on the union."""

        def batch_step(k: int, total: int, active: list[int]) -> set[int]:
            stop = set(on_step(k, total, active)) if on_step is not None else set()
            return self._agreed_stop(stop, len(requests))

        return self._sample(requests, width, height, steps, batch_step)

    def _agreed_stop(self, stop: set[int], n: int) -> set[int]:
        return agreed_stop_set(stop, n, self.parallel.rank, self.parallel.world, self.device)

    def _sample(
        self,
        requests: Sequence[BatchRequest],
        width: int,
        height: int,
        steps: int,
        on_step: BatchStepCallback,
    ) -> list[torch.Tensor | None]:
        for req in requests:
            self._check_prefix(req.prefix_rows, req.guidance_scale)
        b = self.bagel
        grid_h, grid_w = b.grid(width, height)
        n = grid_h * grid_w
        pos = self.model.position_ids(grid_h, grid_w)
        rows_of = [[[(k.to(self.device), v.to(self.device)) for k, v in row] for row in req.prefix_rows] for req in requests]
        xs = [initial_noise(req.seed, (n, b.patch_dim), dtype=torch.float32, device=self.device) for req in requests]
        # One scheduler per request: diffusers' scheduler keeps its step index.
        schedulers = [flow_match_scheduler(steps, b.timestep_shift, device="cpu") for _ in requests]
        timesteps, sigmas = schedulers[0].timesteps, schedulers[0].sigmas
        lo, hi = b.cfg_interval
        results: list[torch.Tensor | None] = [None] * len(requests)
        active = list(range(len(requests)))
        for k in range(steps):
            sigma = float(sigmas[k])
            # BAGEL runs the unconditional row only inside the CFG interval.
            guided = [len(rows_of[i]) == 2 and lo < sigma <= hi for i in active]
            use = [rows_of[i] if g else rows_of[i][:1] for i, g in zip(active, guided, strict=True)]
            counts = [len(u) for u in use]
            flat = [row for u in use for row in u]
            batch = torch.cat([xs[i].to(self.dtype)[None].expand(c, n, b.patch_dim) for i, c in zip(active, counts, strict=True)])
            t = torch.full((len(flat),), sigma, dtype=torch.float32, device=self.device)
            v_all = self.model(batch, t, pos, flat, [row[0][0].shape[1] for row in flat]).float()
            for i, g, v in zip(active, guided, v_all.split(counts), strict=True):
                velocity = guided_velocity(
                    v[0], v[1], requests[i].guidance_scale, renorm_type=b.cfg_renorm_type, renorm_min=b.cfg_renorm_min
                ) if g else v[0]
                xs[i] = schedulers[i].step(velocity.cpu(), timesteps[k], xs[i].cpu(), return_dict=False)[0].to(self.device)
            stop = set(on_step(k + 1, steps, list(active))) & set(active)
            active = [i for i in active if i not in stop]
            if not active:
                return results
        for i in active:
            results[i] = self.unpatchify(xs[i], grid_h, grid_w)
        return results

    def unpatchify(self, tokens: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """[h*w, p*p*C] (BAGEL's `hwpqc` token order) -> [C, h*p, w*p]."""
        p, c = self.bagel.latent_patch_size, self.bagel.latent_channels
        x = tokens.reshape(grid_h, grid_w, p, p, c)
        return torch.einsum("hwpqc->chpwq", x).reshape(c, grid_h * p, grid_w * p)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise RuntimeError(f"rank {self.parallel.rank} does not decode (rank 0 does)")
        return self.decoder(latents)

    def generate(self, prefix_rows: Sequence[PrefixRow], **kwargs: Any) -> torch.Tensor:
        return self.decode(self.denoise(prefix_rows, **kwargs))


def patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)*(W/p), p*p*C] in BAGEL's `chpwq -> hwpqc` order."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // patch, patch, w // patch, patch)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(b, (h // patch) * (w // patch), patch * patch * c)
