"""Probe the DiT step's parts at the bagel-7b-shape seed shape (2 CFG rows x 1,024 image tokens,
96-token prefixes) on one GPU: each GEMM's rate against the 8192^3 matmul, the prefix attention
per SDPA backend (with and without the padding mask), and the GEMMs through inductor's
max-autotune. Prints one line per probe. Run on the GPU machine:

    python3 benchmarks/gpu/probe_dit.py [--autotune]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def ms(fn: Any, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument("--gemms-only", action="store_true")
    args = parser.parse_args()
    dev, bf = "cuda", torch.bfloat16
    a = torch.randn(8192, 8192, device=dev, dtype=bf)
    peak = 2 * 8192**3 / (ms(lambda: a @ a) / 1e3) / 1e12
    print(f"{torch.cuda.get_device_name()}: 8192^3 bf16 {peak:.0f} TFLOP/s", flush=True)
    m, h, mlp, hq, hkv, d = 2048, 3584, 18944, 28, 4, 128
    shapes = {"qkv": (h, (hq + 2 * hkv) * d), "o": (hq * d, h), "gate_up": (h, 2 * mlp), "down": (mlp, h)}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        total = 0.0
        for name, (k, n) in shapes.items():
            x = torch.randn(m, k, device=dev, dtype=bf)
            w = torch.randn(n, k, device=dev, dtype=bf)
            t = ms(lambda x=x, w=w: F.linear(x, w))
            total += t
            print(f"{library} gemm {name} [{m}x{k}] x [{k}x{n}]: {t * 1e3:.0f} us, "
                  f"{2 * m * k * n / (t / 1e3) / 1e12:.0f} TFLOP/s", flush=True)
        print(f"{library} gemms per layer {total * 1e3:.0f} us, x28 = {total * 28:.2f} ms", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.gemms_only:
        return

    rows, n_img, slots = 2, 1024, 96
    q = torch.randn(rows, hq, n_img, d, device=dev, dtype=bf)
    keys = torch.randn(rows, hkv, slots + n_img, d, device=dev, dtype=bf)
    vals = torch.randn_like(keys)
    mask = torch.ones(rows, 1, 1, slots + n_img, dtype=torch.bool, device=dev)
    mask[1, :, :, 16:slots] = False
    folded = q.reshape(rows, hkv, hq // hkv * n_img, d)
    flops = 4 * rows * hq * n_img * (slots + n_img) * d
    variants: dict[str, Any] = {
        "folded, mask, default": lambda: F.scaled_dot_product_attention(folded, keys, vals, attn_mask=mask),
        "folded, no mask, default": lambda: F.scaled_dot_product_attention(folded, keys, vals),
        "enable_gqa, mask, default": lambda: F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True),
        "enable_gqa, no mask, default": lambda: F.scaled_dot_product_attention(q, keys, vals, enable_gqa=True),
    }
    for name, fn in variants.items():
        print(f"attention {name}: {ms(fn) * 1e3:.0f} us, {flops / (ms(fn) / 1e3) / 1e12:.0f} TFLOP/s", flush=True)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for masked in (False, True):
            try:
                with sdpa_kernel([backend]):
                    fn = (lambda: F.scaled_dot_product_attention(folded, keys, vals, attn_mask=mask)) if masked else (
                        lambda: F.scaled_dot_product_attention(folded, keys, vals))
                    t = ms(fn)
                print(f"attention folded {backend.name} {'mask' if masked else 'no mask'}: {t * 1e3:.0f} us, "
                      f"{flops / (t / 1e3) / 1e12:.0f} TFLOP/s", flush=True)
            except Exception as err:  # noqa: BLE001 - a probe: report and go on
                print(f"attention folded {backend.name} {'mask' if masked else 'no mask'}: unavailable ({str(err)[:120]})")

    if args.autotune:
        import torch._inductor.config as ic
        ic.max_autotune_gemm_backends = "TRITON,ATEN"
        for name in ("down", "gate_up", "qkv"):
            k, n = shapes[name]
            x = torch.randn(m, k, device=dev, dtype=bf)
            w = torch.randn(n, k, device=dev, dtype=bf)
            f = torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False)
            t0 = time.perf_counter()
            f(x, w)
            torch.cuda.synchronize()
            t = ms(lambda x=x, w=w, f=f: f(x, w))
            print(f"autotuned gemm {name}: {t * 1e3:.0f} us, {2 * m * k * n / (t / 1e3) / 1e12:.0f} TFLOP/s "
                  f"(tuning {time.perf_counter() - t0:.0f} s)", flush=True)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
