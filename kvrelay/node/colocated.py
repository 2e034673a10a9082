"""AR and DiT in one process with the KV handed over in memory: the no-transfer baseline.

`kvrelay bench --colocated` measures disaggregation against this. The prefix still goes through
the same HND pages the DiT reads in a disaggregated deployment (written with a plain copy instead of
a transport), so the two differ only in where the work runs and how the bytes move. A composition
root like the CLI: it is the one place besides the CLI allowed to import both services.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvrelay.models.paged_attention import read_prefix, write_prefix
from kvrelay.models.presets import get_preset


class ColocatedPipeline:
    def __init__(
        self,
        preset: str,
        *,
        page_size: int = 16,
        weight_seed: int = 0,
        device: str = "cpu",
        max_batch: int = 1,
        quantization: str | None = None,
    ) -> None:
        from kvrelay.models.ar import build_ar_model
        from kvrelay.models.dit import DitRunner
        from kvrelay.models.tokenizer import ByteTokenizer

        self.preset = get_preset(preset)
        self.tokenizer = ByteTokenizer()
        self.ar = build_ar_model(preset=preset, seed=weight_seed, device=device)
        # The DiT as the served DiT stage runs it (`model.quantization`); the AR is never quantized.
        self.dit = DitRunner(self.preset, weight_seed=weight_seed, device=device, quantization=quantization)
        self.layout = self.dit.page_layout(page_size)
        # Room for two CFG rows of the longest prompt per request of a batch (max_num_seqs).
        self.max_batch = max_batch
        self.pages_per_row = self.layout.geometry.pages_for(self.preset.ar.max_tokens + 1)
        self.pool = torch.zeros(
            2 * max_batch * self.pages_per_row * self.layout.page_bytes, dtype=torch.uint8, device=device
        )
        self.ar.warm_up()
        self.dit.warm_up()
        # PNG encoding off the GPU's critical path, as the served DiT does it (one host thread per
        # image in flight is plenty: Pillow releases the GIL while it encodes).
        self._encoder = ThreadPoolExecutor(max_workers=max(2, max_batch), thread_name_prefix="png")

    def prefill(self, texts: list[str]) -> list[torch.Tensor]:
        """Each CFG row's KV, [num_layers, 2, num_kv_heads, T, head_dim] (all rows in one batch)."""
        return self.ar.prefill_batch([self.tokenizer.encode(text) for text in texts])

    def hand_over(self, kvs: list[torch.Tensor]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Write each row's KV into its pages and read it back as the DiT does: the in-memory
        stand-in for a transfer (row r takes pages from r * pages_per_row)."""
        prefix_rows = []
        for row, kv in enumerate(kvs):
            n = kv.shape[3]
            start = row * self.pages_per_row
            pages = list(range(start, start + self.layout.geometry.pages_for(n)))
            write_prefix(self.pool, self.layout, pages, [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])])
            prefix_rows.append(read_prefix(self.pool, self.layout, pages, n))
        return prefix_rows

    def generate_batch(
        self, requests: list[tuple[str, str, int]], width: int, height: int, steps: int, guidance_scale: float
    ) -> tuple[dict[str, float], Future[float]]:
        """Up to ``max_batch`` generations together, as a served replica with that max_num_seqs
        runs them: one batched prefill of all their CFG rows, the hand-over, one batched denoise,
        then each decode to host pixels. ``requests``: (prompt, negative prompt, seed). Returns the
        batch's phase timings (seconds), which every request of the batch shares, and a future of
        the PNG encoding: like a served replica, the encode runs on a host thread while the next
        batch uses the GPU (the future's result is the encode's seconds)."""
        from kvrelay.models.dit import BatchRequest

        if not 0 < len(requests) <= self.max_batch:
            raise ValueError(f"{len(requests)} requests for a batch of at most {self.max_batch}")
        sync = torch.cuda.synchronize if self.pool.is_cuda else (lambda: None)
        t0 = time.perf_counter()
        per = 2 if guidance_scale > 1.0 else 1
        texts = [t for p, n, _ in requests for t in ([p, n] if per == 2 else [p])]
        kvs = self.prefill(texts)
        sync()
        t1 = time.perf_counter()
        rows = self.hand_over(kvs)
        sync()
        t2 = time.perf_counter()
        batch = [BatchRequest(rows[i * per : (i + 1) * per], guidance_scale, seed) for i, (_, _, seed) in
                 enumerate(requests)]
        latents = self.dit.denoise_batch(batch, width=width, height=height, steps=steps)
        sync()
        t3 = time.perf_counter()
        images = []
        for lat in latents:
            assert lat is not None
            images.append(self.dit.decode(lat).cpu().numpy())
        t4 = time.perf_counter()
        phases = {
            "prefill_seconds": t1 - t0,
            "transfer_seconds": t2 - t1,
            "handoff_seconds": t2 - t1,
            "load_seconds": 0.0,
            "denoise_seconds": t3 - t2,
            "decode_seconds": t4 - t3,
            "total_seconds": t4 - t0,
        }
        return phases, self._encoder.submit(_encode_all, images)

    def close(self) -> None:
        self._encoder.shutdown(wait=True)

    def generate(
        self, prompt: str, negative_prompt: str, seed: int, width: int, height: int, steps: int, guidance_scale: float
    ) -> dict[str, float]:
        """One generation; returns its phase timings (seconds) like a served request's."""
        from kvrelay.models.image import encode_png

        sync = torch.cuda.synchronize if self.pool.is_cuda else (lambda: None)
        t0 = time.perf_counter()
        texts = [prompt, negative_prompt] if guidance_scale > 1.0 else [prompt]
        kvs = self.prefill(texts)
        sync()
        t1 = time.perf_counter()
        prefix_rows = self.hand_over(kvs)
        sync()
        t2 = time.perf_counter()
        latents = self.dit.denoise(
            prefix_rows, width=width, height=height, steps=steps, guidance_scale=guidance_scale, seed=seed
        )
        sync()
        t3 = time.perf_counter()
        png = encode_png(self.dit.decode(latents))
        t4 = time.perf_counter()
        assert png
        return {
            "prefill_seconds": t1 - t0,
            "transfer_seconds": t2 - t1,
            "handoff_seconds": t2 - t1,
            "load_seconds": 0.0,
            "denoise_seconds": t3 - t2,
            "decode_seconds": t4 - t3,
            "total_seconds": t4 - t0,
        }


def _encode_all(images: list[np.ndarray]) -> float:
    from kvrelay.models.image import encode_png

    start = time.perf_counter()
    for image in images:
        assert encode_png(image)
    return time.perf_counter() - start
