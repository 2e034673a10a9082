"""Where the DiT step's padding mask costs, on one GPU (bagel-7b-shape, 512x512, 2 CFG rows).

A captured step serves every prompt length of its prefix bucket, so rows shorter than the bucket
are masked. This probe times, side by side in one process:

1. the prefix attention alone at the step's shape, eager and through torch.compile, with the mask
   given as today (bool ``[rows, 1, 1, L]``), as an additive bias ``[rows, 1, 1, L]``, as that bias
   expanded (a stride-0 view), as a materialized bias, without a mask, and FlashAttention with
   ``seqused_k`` (keys ordered ``[image | prefix | padding]``), each checked against the bool form;
2. the whole graph-captured DiT step as the code runs it (``traced_bool``) and with the bias
   built once per denoise (``traced_bias``) and the SDPA call outside inductor (``eager_bias``)
   patched in, each
   mode in a fresh runner (the compiled block traces the patched function), with the step's
   kernel time against its wall time (the gaps) and the SM clock / power after the timed run.

    python3 benchmarks/gpu/probe_attention.py [--modes traced_bool,traced_bias,eager_bias] [--reps 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import kvrelay.models.dit as dit_mod
import kvrelay.models.paged_attention as pa
from kvrelay.models.dit import DitRunner, random_prefix


def device_ms(fn: Any, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def attention_alone(reps: int) -> None:
    dev, dt = "cuda", torch.bfloat16
    rows, hkv, group, n, d, slots = 2, 4, 7, 1024, 128, 128
    length = slots + n
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(rows, hkv, group * n, d, device=dev, dtype=dt, generator=g)
    keys = torch.randn(rows, hkv, length, d, device=dev, dtype=dt, generator=g)
    vals = torch.randn(rows, hkv, length, d, device=dev, dtype=dt, generator=g)
    lengths = [81, 16]
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=dev)
    for r, t in enumerate(lengths):
        mask[r, ..., t:slots] = False
    bias = torch.zeros(rows, 1, 1, length, dtype=dt, device=dev).masked_fill_(~mask, float("-inf"))
    full = bias.expand(rows, hkv, group * n, length).contiguous()
    # FlashAttention layout: [rows, L, heads, d], keys [image | prefix | pad], seqused_k = n + T_r.
    k_img_first = torch.cat([keys[:, :, slots:], keys[:, :, :slots]], dim=2)
    v_img_first = torch.cat([vals[:, :, slots:], vals[:, :, :slots]], dim=2)
    seqused = torch.tensor([n + t for t in lengths], dtype=torch.int32, device=dev)

    def flash() -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k_img_first.transpose(1, 2), v_img_first.transpose(1, 2), None, None,
            group * n, length, 0.0, False, False, seqused_k=seqused,
        )[0]
        return out.transpose(1, 2)

    variants: dict[str, Any] = {
        "bool mask [r,1,1,L]": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "bias [r,1,1,L]": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        "bias expanded (stride 0)": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.expand(rows, hkv, group * n, length)),
        "bias materialized": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=full),
        "no mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    }
    ref = variants["bool mask [r,1,1,L]"](q, keys, vals)
    flops = 4 * rows * hkv * group * n * length * d
    for name, fn in variants.items():
        for how in ("eager", "compiled"):
            try:
                call = fn if how == "eager" else torch.compile(fn, fullgraph=True, dynamic=False)
                out = call(q, keys, vals)
                diff = (out.float() - ref.float()).abs().max().item() if name != "no mask" else float("nan")
                t = device_ms(lambda call=call: call(q, keys, vals), reps)
                print(f"attention {name}, {how}: {t * 1e3:.0f} us ({flops / t / 1e9:.0f} TFLOP/s), "
                      f"max|diff| vs bool {diff:.3g}", flush=True)
            except Exception as err:  # noqa: BLE001 - a probe: report and go on
                print(f"attention {name}, {how}: failed {str(err)[:300]!r}", flush=True)
    try:
        out = flash()
        diff = (out.float() - ref.float()).abs().max().item()
        t = device_ms(flash, reps)
        print(f"attention flash seqused_k: {t * 1e3:.0f} us, max|diff| vs bool {diff:.3g}", flush=True)
    except Exception as err:  # noqa: BLE001
        print(f"attention flash seqused_k: failed {str(err)[:300]!r}", flush=True)


# --- whole-step variants -------------------------------------------------------------------
# "traced_bool": the code as it is (PrefixKv keeps a bool mask; inductor traces the SDPA call in
# the compiled block and converts the mask every layer). "traced_bias": PrefixKv keeps an additive
# bias built once per denoise instead. "eager_bias": that bias, and the SDPA call run outside
# inductor (torch.compiler.disable: a graph break, still captured by the step's CUDA graph).

_ORIG_FILL = pa.PrefixKv.fill
_ORIG_ALLOCATE = pa.PrefixKv.allocate.__func__  # type: ignore[attr-defined]
_ORIG_GQA = dit_mod.gqa_attention


def _bias_allocate(cls: Any, *args: Any, **kwargs: Any) -> Any:
    kv = _ORIG_ALLOCATE(cls, *args, **kwargs)
    if kv.mask is not None:
        kv.mask = torch.zeros(kv.mask.shape, dtype=kv.block.dtype, device=kv.block.device)
    return kv


def _bias_fill(self: Any, prefix_rows: Any, *, num_valid: int | None = None) -> None:
    held = self.mask
    self.mask = None  # the code's fill then leaves its bool keep-mask here (None: all valid)
    _ORIG_FILL(self, prefix_rows, num_valid=num_valid)
    keep = self.mask
    self.mask = held
    if keep is None:
        if held is not None:
            held.zero_()
        return
    bias = torch.zeros(keep.shape, dtype=self.block.dtype, device=self.block.device)
    bias.masked_fill_(~keep, float("-inf"))
    if held is None:
        self.mask = bias
    else:
        held.copy_(bias)


@torch.compiler.disable
def _eager_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any) -> torch.Tensor:
    out: torch.Tensor = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out


def _gqa_eager(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any = None) -> torch.Tensor:
    rows, heads_q, n, head_dim = q.shape
    heads_kv = keys.shape[1]
    folded = q.reshape(rows, heads_kv, (heads_q // heads_kv) * n, head_dim)
    return _eager_sdpa(folded, keys, values, mask).reshape(rows, heads_q, n, head_dim)


def set_mode(mode: str) -> None:
    pa.PrefixKv.fill = _ORIG_FILL  # type: ignore[method-assign]
    pa.PrefixKv.allocate = classmethod(_ORIG_ALLOCATE)  # type: ignore[method-assign]
    dit_mod.gqa_attention = _ORIG_GQA
    if mode.endswith("_bias"):
        pa.PrefixKv.fill = _bias_fill  # type: ignore[method-assign]
        pa.PrefixKv.allocate = classmethod(_bias_allocate)  # type: ignore[method-assign]
    if mode == "eager_bias":
        dit_mod.gqa_attention = _gqa_eager


def kernel_time(fn: Any) -> tuple[float, float, list[tuple[str, float]]]:
    """(sum of kernel durations ms, span first-start..last-end ms, top kernels) of one call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return 0.0, 0.0, []
    busy = sum(e.device_time_total for e in kernels) / 1e3 if hasattr(kernels[0], "device_time_total") else 0.0
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:70]] = by_name.get(e.name[:70], 0.0) + e.time_range.elapsed_us() / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    return busy, (end - start) / 1e3, top


def whole_step(modes: list[str], reps: int, preset: str = "bagel-7b-shape", device: str = "cuda",
               lat_hw: int = 64) -> dict[str, Any]:
    result: dict[str, Any] = {}
    graphs_of: dict[tuple[str, tuple[int, ...]], Any] = {}
    keep: list[Any] = []
    for mode in modes:
        set_mode(mode)
        torch._dynamo.reset()
        runner = DitRunner(preset, device=device, prefix_bucket=64)
        kv_dtype = getattr(torch, runner.preset.dtype)
        for lengths in ((81, 16), (96, 96)):
            rows = [random_prefix(runner.preset, t, seed=i, dtype=kv_dtype, device="cuda") for i, t in enumerate(lengths)]
            lat = torch.randn(len(rows), 16, 64, 64, device="cuda", dtype=runner.dtype,
                              generator=torch.Generator(device="cuda").manual_seed(1))
            out: dict[str, Any] = {}
            for graphs in (True, False):
                runner.use_graphs = graphs
                step = runner.stepper(rows, 64, 64)
                v = step(lat, 0.5).clone()
                ms = device_ms(lambda step=step, lat=lat: step(lat, 0.5), reps)
                out["graph" if graphs else "eager"] = ms
                out[f"v_{'graph' if graphs else 'eager'}"] = v
            runner.use_graphs = True
            step = runner.stepper(rows, 64, 64)
            busy, span, top = kernel_time(lambda step=step, lat=lat: step(lat, 0.5))
            for _ in range(40):  # sustained: clocks and power as in a served run
                step(lat, 0.5)
            torch.cuda.synchronize()
            sustained = device_ms(lambda step=step, lat=lat: step(lat, 0.5), reps)
            try:
                clock, power = torch.cuda.clock_rate(), torch.cuda.power_draw() / 1e3
            except Exception:  # noqa: BLE001 - nvml may be missing
                clock, power = -1, -1.0
            same = torch.equal(out["v_graph"], out["v_eager"])
            key = f"{mode} {list(lengths)}"
            base = f"{modes[0]} {list(lengths)}"
            if mode != modes[0] and base in result:
                ref = result[base]["v"]
                rel = ((out["v_graph"].float() - ref.float()).norm() / ref.float().norm()).item()
            else:
                rel = 0.0
            result[key] = {"graph_ms": out["graph"], "eager_ms": out["eager"], "sustained_ms": sustained,
                           "v": out["v_graph"], "busy_ms": busy, "span_ms": span}
            print(f"step {key}: graph {out['graph']:.2f} ms, eager {out['eager']:.2f} ms, sustained graph "
                  f"{sustained:.2f} ms (SM {clock} MHz, {power:.0f} W); graph==eager {same}; rel diff vs first mode "
                  f"{rel:.2e}; one graph replay's kernels {busy:.2f} ms busy in a {span:.2f} ms span", flush=True)
            for name, t in top:
                print(f"    {t:7.2f} ms  {name}", flush=True)
            graphs_of[(mode, lengths)] = (runner, rows, lat)
        keep.append(runner)
    # Interleaved: the captured steps of every mode replayed in turn, 8 rounds x 10 steps each,
    # so every mode sees the same clocks and power (the step runs at the GPU's power limit).
    for lengths in ((81, 16), (96, 96)):
        per: dict[str, list[float]] = {m: [] for m in modes}
        steps = {}
        for mode in modes:  # each runner's one graph of this bucket, refilled with these rows
            runner, rows, lat = graphs_of[(mode, lengths)]
            runner.use_graphs = True
            steps[mode] = (runner.stepper(rows, 64, 64), lat)
        for _ in range(8):
            for mode in modes:
                step, lat = steps[mode]
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10):
                    step(lat, 0.5)
                b.record()
                torch.cuda.synchronize()
                per[mode].append(a.elapsed_time(b) / 10)
        base = statistics.median(per[modes[0]])
        for mode in modes:
            med = statistics.median(per[mode])
            spread = (max(per[mode]) - min(per[mode])) / 2 / med * 100
            result.setdefault(f"interleaved {list(lengths)}", {})[mode] = med
            print(f"interleaved graph step {list(lengths)} {mode}: {med:.2f} ms (+-{spread:.1f}%), "
                  f"{med / base:.3f}x {modes[0]}", flush=True)
    del keep
    gc.collect()
    torch.cuda.empty_cache()
    return {k: {kk: vv for kk, vv in v.items() if kk != "v"} for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="traced_bool,traced_bias,eager_bias")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--skip-alone", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    if not args.skip_alone:
        attention_alone(args.reps)
    summary = whole_step([m for m in args.modes.split(",") if m], args.reps)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    print("done", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
