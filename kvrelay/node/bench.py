"""`kvrelay bench`: the seed's throughput experiment, reproducible, side by side in one run.

Starts one node per transported implementation (Mooncake; the gRPC-stream fallback, i.e. the same
config without `kv_transfer_config`; with `--dit-parallel`, one Mooncake node per DiT layout of
DIT_LAYOUTS: TP=1, CFG=2 x TP=1, TP=2 with EP off and on) plus the colocated baseline (AR and DiT in this process, KV
handed over in memory), warms each up, then runs N independent runs of M requests at concurrency C
cycling through the dataset, implementations interleaved run by run so that machine drift hits all
alike. It reports req/s, latency percentiles, handoff time and its share of latency, and bytes
moved, per run and mean; each implementation's ratio to the fallback in the seed's table format;
and writes JSON plus PNG plots to the output folder.

A composition root like the CLI: it may import services (the colocated baseline runs them in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvrelay.config import ConfigError, KvRelayConfig, load_config, parse_config
from kvrelay.limits import MAX_DATASET_FILE_BYTES, FileRefused, read_bounded_file
from kvrelay.logging import configure_logging
from kvrelay.resources import resolve
from kvrelay.server import reserve_free_port
from kvrelay.suggest import did_you_mean

IMPL_LABELS = {
    "grpc": "gRPC stream fallback (legacy path)",
    "mooncake": "Native MooncakeConnector",
    "cuda_ipc": "CudaIpcConnector (same host, GPU to GPU)",
    "colocated": "Colocated (no transfer)",
    "vllm": "vLLM AR engine (KvRelayConnector, Mooncake)",
}

# DiT parallel layouts (issue 21), each a Mooncake node whose DiT stage gets these keys; everything
# else (AR, concurrency, max_num_seqs, workload) is the same for all. `--dit-parallel` runs them all.
DIT_LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dit-tp1": ("DiT TP=1 (1 rank), CFG off",
                {"tensor_parallel_size": 1, "cfg_parallel_size": 1, "enable_expert_parallel": False}),
    "dit-cfg2": ("DiT CFG=2 x TP=1 (2 ranks)",
                 {"tensor_parallel_size": 1, "cfg_parallel_size": 2, "enable_expert_parallel": False}),
    "dit-tp2": ("DiT TP=2 (2 ranks), EP off",
                {"tensor_parallel_size": 2, "cfg_parallel_size": 1, "enable_expert_parallel": False}),
    "dit-tp2-ep": ("DiT TP=2 (2 ranks), EP on",
                   {"tensor_parallel_size": 2, "cfg_parallel_size": 1, "enable_expert_parallel": True}),
}
IMPL_LABELS.update({name: label for name, (label, _) in DIT_LAYOUTS.items()})
# (on, off, what): the comparisons `--dit-parallel` prints, each with the same concurrency/batching.
PARALLEL_PAIRS = (
    ("dit-tp2-ep", "dit-tp2", "EP on / EP off (TP=2)"),
    ("dit-cfg2", "dit-tp1", "CFG-parallel on / off (TP=1; 2 ranks vs 1)"),
    ("dit-cfg2", "dit-tp2", "CFG=2 x TP=1 / TP=2 (2 ranks each)"),
)


@dataclass
class RequestRecord:
    ok: bool
    latency_s: float
    handoff_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass
class RunResult:
    impl: str
    run: int
    requests: int
    completed: int
    failed: int
    wall_s: float
    req_per_s: float
    latency_p50: float
    latency_p95: float
    latency_p99: float
    handoff_p50: float
    handoff_p99: float
    handoff_share: float
    bytes_moved: int
    phase_means: dict[str, float]
    latencies: list[float]
    errors: list[str]
    # AR engine time per prefilled token over the run (kvrelay_ar_prefill_* on the AR's metrics);
    # None where no served AR ran (the colocated baseline): printed "n/a", never a measured 0.
    prefill_tokens_per_s: float | None = None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summarize(
    impl: str, run: int, records: list[RequestRecord], wall_s: float, bytes_moved: int
) -> RunResult:
    done = [r for r in records if r.ok]
    lat = [r.latency_s for r in done]
    handoff = [r.handoff_s for r in done]
    phases: dict[str, float] = {}
    for r in done:
        for key, value in r.phases.items():
            phases[key] = phases.get(key, 0.0) + value
    return RunResult(
        impl=impl,
        run=run,
        requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        wall_s=wall_s,
        req_per_s=len(done) / wall_s if wall_s > 0 else 0.0,
        latency_p50=percentile(lat, 50),
        latency_p95=percentile(lat, 95),
        latency_p99=percentile(lat, 99),
        handoff_p50=percentile(handoff, 50),
        handoff_p99=percentile(handoff, 99),
        handoff_share=(sum(handoff) / sum(lat)) if lat and sum(lat) > 0 else 0.0,
        bytes_moved=bytes_moved,
        phase_means={k: v / len(done) for k, v in phases.items()} if done else {},
        latencies=lat,
        errors=sorted({r.error for r in records if not r.ok})[:10],
    )


def load_dataset(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    rows = []
    try:
        text = read_bounded_file(path, MAX_DATASET_FILE_BYTES, "JSONL dataset").decode("utf-8")
    except FileRefused as err:
        raise ValueError(f"dataset {path}: {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"dataset {path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"dataset {path} line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"dataset {path} line {number}: expected an object with a \"prompt\" string")
        rows.append(row)
    if not rows:
        raise ValueError(f"dataset {path} is empty")
    return rows


def _input_error(err: Exception) -> str:
    if isinstance(err, FileNotFoundError):
        return f"file not found: {err.filename}"
    if isinstance(err, OSError):
        return f"{err.filename}: {err.strerror or err}"
    return str(err)


# ------------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    preset: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    prompts: list[dict[str, Any]]


def seed_workload(args: argparse.Namespace, preset: str, dataset: list[dict[str, Any]]) -> Workload:
    return Workload("seed", preset, args.width, args.height, args.steps, args.guidance_scale, dataset)


def transfer_workload(dataset: list[dict[str, Any]], preset: str, max_tokens: int) -> Workload:
    """Long prompts and negative prompts, tiny image work (64x64, one step): the transport decides throughput.

    Prompts are the dataset's, repeated up to about 90% of the AR's max tokens (byte tokenizer:
    one token per byte plus BOS), so every request moves a long prefix for both CFG rows.
    """
    target = int(max_tokens * 0.9)
    prompts = []

    def stretch(seed_text: str) -> str:
        text = seed_text
        while len(text.encode()) + len(seed_text.encode()) + 2 < target:
            text = f"{text}; {seed_text}"
        return text

    for row in dataset:
        prompts.append(
            {**row, "prompt": stretch(row["prompt"]), "negative_prompt": stretch(row["negative_prompt"] or "low quality")}
        )
    return Workload("transfer", preset, 64, 64, 1, 2.0, prompts)


# ------------------------------------------------------------------------------------------------
# Driving a node
# ------------------------------------------------------------------------------------------------


async def drive(
    target: str,
    workload: Workload,
    requests: int,
    concurrency: int,
    offset: int,
    client_options: dict[str, Any] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    from kvrelay.client import AsyncKvRelayClient, KvRelayError

    records: list[RequestRecord] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async with AsyncKvRelayClient(target, timeout=600.0, **(client_options or {})) as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                row = workload.prompts[(offset + i) % len(workload.prompts)]
                start = time.perf_counter()
                try:
                    handle = await client.generate(
                        row["prompt"],
                        negative_prompt=row.get("negative_prompt", ""),
                        seed=int(row["seed"]),
                        width=workload.width,
                        height=workload.height,
                        num_inference_steps=workload.steps,
                        guidance_scale=workload.guidance_scale,
                        timeout=600.0,
                    )
                    result = await handle.result()
                    timings = result.timings.as_dict()
                    records.append(
                        RequestRecord(
                            True, time.perf_counter() - start, timings.get("handoff_seconds", 0.0), timings
                        )
                    )
                except KvRelayError as err:
                    records.append(
                        RequestRecord(False, time.perf_counter() - start, error=f"{err.code} {err.reason}")
                    )
                if on_done is not None:
                    on_done(records[-1])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def scrape_counter(url: str, name: str) -> float:
    """Sum of a Prometheus counter's samples at `url` (0 when absent)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


def ar_model_config(impl: str, ar_model: str | None, data: dict[str, Any]) -> dict[str, Any]:
    """The AR stage's model for `impl` when the engines are compared on one checkpoint: vLLM
    (`engine: vllm`) or the built-in AR, both reading `ar_model` with its own tokenizer (the same
    token ids for both) in the DiT's dtype (the KV geometry must match)."""
    if not ar_model:
        raise ValueError("impl vllm needs --ar-model DIR (a Llama/Qwen2 checkpoint with its tokenizer)")
    from kvrelay.models.presets import get_preset

    dit = next(s for s in data["stages"] if s["kind"] == "dit")
    dtype = dit["model"].get("dtype") or get_preset(dit["model"]["preset"]).dtype
    model: dict[str, Any] = {"path": ar_model, "tokenizer": ar_model, "dtype": dtype}
    if impl == "vllm":
        model = {"engine": "vllm", "path": ar_model, "dtype": dtype}
    return model


def impl_config(impl: str, base: dict[str, Any], ar_model: str | None = None) -> dict[str, Any]:
    """`base` (a config as data) as the node of `impl` runs it: its transport (none for the gRPC
    fallback), its DiT layout, its AR model. Ports and the journal are the node's own (NodeUnderTest)."""
    data: dict[str, Any] = json.loads(json.dumps(base))
    for stage in data["stages"]:
        if stage["kind"] == "ar" and (impl == "vllm" or ar_model):
            stage["model"] = ar_model_config(impl, ar_model, data)
        if stage["kind"] == "dit" and impl in DIT_LAYOUTS:
            stage.update(DIT_LAYOUTS[impl][1])
        if impl == "grpc":
            stage.pop("kv_transfer_config", None)
        elif impl == "cuda_ipc":
            kv = stage.setdefault("kv_transfer_config", {})
            kv["kv_connector"] = "CudaIpcConnector"
            kv.setdefault("kv_role", "kv_producer" if stage["kind"] == "ar" else "kv_consumer")
    return data


class NodeUnderTest:
    """One `kvrelay up`-style node (broker + AR + DiT processes) for one implementation."""

    def __init__(self, impl: str, base: dict[str, Any], workdir: Path, ar_model: str | None = None) -> None:
        from kvrelay.node.supervisor import start_node

        self.impl = impl
        data = impl_config(impl, base, ar_model)
        data["broker"]["port"] = reserve_free_port()
        data["broker"]["metrics_port"] = reserve_free_port()
        data["broker"]["journal_path"] = str(workdir / f"{impl}-broker.sqlite")
        for stage in data["stages"]:
            stage["port"] = reserve_free_port()
            stage["metrics_port"] = reserve_free_port()
        self.config: KvRelayConfig = parse_config(data, f"bench-{impl}")
        self.config_path = workdir / f"{impl}.yaml"
        self.config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.target = f"{self.config.broker.host}:{self.config.broker.port}"
        ar = self.config.ar_stage
        self.ar_metrics = [
            f"http://{ar.host}:{ar.metrics_port_for(r)}/metrics" for r in range(ar.num_replicas)
        ]
        # Each node runs in its own folder: replica lock files and state never collide.
        rundir = workdir / impl
        rundir.mkdir(parents=True, exist_ok=True)
        self.node = start_node(self.config_path, log_dir=workdir / f"{impl}-logs", cwd=rundir)

    def bytes_moved(self) -> float:
        return sum(scrape_counter(url, "kvrelay_transfer_bytes_total") for url in self.ar_metrics)

    def prefill_counters(self) -> tuple[float, float]:
        """(tokens prefilled, seconds of AR engine time) so far, over every AR replica."""
        tokens = sum(scrape_counter(url, "kvrelay_ar_prefill_tokens_total") for url in self.ar_metrics)
        seconds = sum(scrape_counter(url, "kvrelay_ar_prefill_seconds_sum") for url in self.ar_metrics)
        return tokens, seconds

    def run(
        self,
        workload: Workload,
        requests: int,
        concurrency: int,
        run_idx: int,
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> tuple[list[RequestRecord], float, int]:
        before = self.bytes_moved()
        tokens0, seconds0 = self.prefill_counters()
        start = time.perf_counter()
        records = asyncio.run(
            drive(
                self.target, workload, requests, concurrency, offset=run_idx * requests,
                client_options=self.node.credentials.client_options(), on_done=on_done,
            )
        )
        wall = time.perf_counter() - start
        tokens1, seconds1 = self.prefill_counters()
        self.last_prefill_tokens_per_s = (tokens1 - tokens0) / (seconds1 - seconds0) if seconds1 > seconds0 else 0.0
        return records, wall, int(self.bytes_moved() - before)

    def stop(self) -> None:
        self.node.stop()


class ColocatedUnderTest:
    """AR and DiT in this process, KV handed over in memory: the no-transfer baseline."""

    impl = "colocated"

    def __init__(self, preset: str, device: str = "cpu", max_batch: int = 1, quantization: str | None = None) -> None:
        from kvrelay.node.colocated import ColocatedPipeline

        self.pipeline = ColocatedPipeline(preset, device=device, max_batch=max_batch, quantization=quantization)

    @classmethod
    def for_config(cls, data: dict[str, Any], preset: str) -> ColocatedUnderTest:
        """The baseline of a config's DiT stage: on its first device, with its max_num_seqs and its
        `model.quantization` (a fair comparison with the served DiT)."""
        dit_stage = parse_config(data).dit_stage
        return cls(preset, dit_stage.devices_for(0)[0], dit_stage.max_num_seqs, dit_stage.model.quantization)

    def run(
        self,
        workload: Workload,
        requests: int,
        concurrency: int,
        run_idx: int,
        on_done: Callable[[RequestRecord], None] | None = None,
    ) -> tuple[list[RequestRecord], float, int]:
        # One process computes both stages with the served DiT's batching: up to max_num_seqs
        # requests (at most `concurrency` are in flight) prefilled and denoised together, batch
        # after batch, each batch's PNGs encoded on a host thread while the next batch runs (as the
        # served DiT does). A request's latency is from its batch's start (all of it arrived at
        # once) to its PNG.
        batch = max(1, min(concurrency, self.pipeline.max_batch))
        records: list[RequestRecord] = []
        start = time.perf_counter()
        pending: list[tuple[float, int, dict[str, float], Future[float]]] = []

        def settle(upto: int) -> None:
            # Wait for the oldest encodes until at most `upto` batches are still encoding.
            while len(pending) > upto:
                t0, n, phases, future = pending.pop(0)
                try:
                    encode = future.result()
                    done = time.perf_counter() - t0
                    phases = {**phases, "decode_seconds": phases["decode_seconds"] + encode,
                              "total_seconds": done}
                    new = [RequestRecord(True, done, phases.get("handoff_seconds", 0.0), phases) for _ in range(n)]
                except Exception as err:  # noqa: BLE001 - a failed request is a result here
                    new = [RequestRecord(False, time.perf_counter() - t0, error=repr(err)) for _ in range(n)]
                records.extend(new)
                if on_done is not None:
                    for record in new:
                        on_done(record)

        for first in range(0, requests, batch):
            rows = [workload.prompts[(run_idx * requests + i) % len(workload.prompts)]
                    for i in range(first, min(requests, first + batch))]
            t0 = time.perf_counter()
            try:
                phases, encoded = self.pipeline.generate_batch(
                    [(r["prompt"], r.get("negative_prompt", ""), int(r["seed"])) for r in rows],
                    workload.width, workload.height, workload.steps, workload.guidance_scale,
                )
                pending.append((t0, len(rows), phases, encoded))
            except Exception as err:  # noqa: BLE001 - a failed request is a result here
                failed = [RequestRecord(False, time.perf_counter() - t0, error=repr(err)) for _ in rows]
                records.extend(failed)
                if on_done is not None:
                    for record in failed:
                        on_done(record)
            # A served replica has at most `concurrency` requests in flight: so does this loop.
            settle(max(0, concurrency // batch - 1))
        settle(0)
        return records, time.perf_counter() - start, 0

    def stop(self) -> None:
        self.pipeline.close()


# ------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------


def seed_table(results: list[RunResult], impls: list[str], runs: int) -> str:
    """The seed's table (req/s per run and mean), plus each implementation's ratio to the fallback."""
    head = (
        "| Implementation | "
        + " | ".join(f"Run {i + 1} (req/s)" for i in range(runs))
        + " | Mean (req/s) | Spread | vs fallback |"
    )
    sep = "| --- | " + " | ".join("---:" for _ in range(runs)) + " | ---: | ---: | ---: |"
    lines = [head, sep]
    means = {
        impl: statistics.mean([r.req_per_s for r in results if r.impl == impl] or [0.0]) for impl in impls
    }
    base = means.get("grpc") or 0.0
    for impl in impls:
        per_run = [r.req_per_s for r in results if r.impl == impl]
        spread = (max(per_run) - min(per_run)) / means[impl] * 100 if per_run and means[impl] else 0.0
        ratio = f"{means[impl] / base:.4f}x ({(means[impl] / base - 1) * 100:+.2f}%)" if base else "n/a"
        cells = " | ".join(f"{v:.4f}" for v in per_run)
        lines.append(f"| {IMPL_LABELS[impl]} | {cells} | {means[impl]:.4f} | ±{spread / 2:.2f}% | {ratio} |")
    return "\n".join(lines)


def detail_table(results: list[RunResult]) -> str:
    lines = [
        "| impl | run | done/failed | req/s | prefill tok/s | p50 s | p95 s | p99 s | queue ms | transfer ms | load ms | "
        "handoff p50 ms | handoff p99 ms | handoff share | MiB moved |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        # Means per request: queue = waiting for the broker and for a DiT slot; transfer = the
        # AR's writes; load = the DiT's own load, from its start (while the call is queued at the
        # DiT when it has a look-ahead place, else at admission) to every row verified (on
        # host-staged transports, nothing of the later mirror copy): it may overlap the queue;
        # handoff = admission (or placement, if later) to loaded: what of the KV handoff is left
        # on the request's path.
        queue, transfer, load = (r.phase_means.get(k, 0.0) * 1e3 for k in
                                 ("queue_seconds", "transfer_seconds", "load_seconds"))
        prefill = "n/a" if r.prefill_tokens_per_s is None else f"{r.prefill_tokens_per_s:.0f}"
        lines.append(
            f"| {r.impl} | {r.run + 1} | {r.completed}/{r.failed} | {r.req_per_s:.4f} | {prefill} | "
            f"{r.latency_p50:.3f} | {r.latency_p95:.3f} | {r.latency_p99:.3f} | {queue:.1f} | {transfer:.1f} | {load:.1f} | "
            f"{r.handoff_p50 * 1e3:.1f} | {r.handoff_p99 * 1e3:.1f} | "
            f"{r.handoff_share * 100:.1f}% | {r.bytes_moved / 2**20:.1f} |"
        )
    return "\n".join(lines)


def engine_table(results: list[RunResult]) -> str:
    """vLLM vs the built-in AR (impl mooncake) on the same checkpoint and transport, measured in
    the same run: means and ratios of req/s and prefill tokens/s. Empty unless both ran."""
    by = {impl: [r for r in results if r.impl == impl] for impl in ("mooncake", "vllm")}
    if not by["mooncake"] or not by["vllm"]:
        return ""
    lines = ["| AR engine | req/s (mean) | prefill tok/s (mean) |", "| --- | ---: | ---: |"]
    means = {}
    for impl, label in (("mooncake", "built-in torch AR"), ("vllm", "vLLM")):
        rps = statistics.mean(r.req_per_s for r in by[impl])
        tps = statistics.mean(r.prefill_tokens_per_s or 0.0 for r in by[impl])
        means[impl] = (rps, tps)
        lines.append(f"| {label} | {rps:.4f} | {tps:.0f} |")
    (b_rps, b_tps), (v_rps, v_tps) = means["mooncake"], means["vllm"]
    lines.append(
        f"| vLLM / built-in | {v_rps / b_rps if b_rps else 0:.3f}x | {v_tps / b_tps if b_tps else 0:.3f}x |"
    )
    return "\n".join(lines)


def parallel_table(results: list[RunResult]) -> str:
    """DiT layouts side by side (`--dit-parallel`): means per layout, then EP on/off and
    CFG-parallel on/off as ratios (>1: faster). Empty unless at least one pair of layouts ran."""
    by = {name: [r for r in results if r.impl == name] for name in DIT_LAYOUTS}
    ran = [name for name in DIT_LAYOUTS if by[name]]
    if not any(by[on] and by[off] for on, off, _ in PARALLEL_PAIRS):
        return ""

    def mean(name: str, key: Callable[[RunResult], float]) -> float:
        return statistics.mean(key(r) for r in by[name])

    def denoise_ms(r: RunResult) -> float:
        return r.phase_means.get("denoise_seconds", 0.0) * 1e3

    lines = [
        "| DiT layout | req/s (mean) | p50 latency s | denoise ms/request | MiB moved/request |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in ran:
        moved = mean(name, lambda r: r.bytes_moved / max(1, r.completed) / 2**20)
        lines.append(
            f"| {DIT_LAYOUTS[name][0]} | {mean(name, lambda r: r.req_per_s):.4f} | "
            f"{mean(name, lambda r: r.latency_p50):.3f} | {mean(name, denoise_ms):.1f} | {moved:.3f} |"
        )
    lines += ["", "| comparison | req/s ratio | denoise time ratio (off / on) |", "| --- | ---: | ---: |"]
    for on, off, what in PARALLEL_PAIRS:
        if not (by[on] and by[off]):
            continue
        rps_on, rps_off = mean(on, lambda r: r.req_per_s), mean(off, lambda r: r.req_per_s)
        dn_on, dn_off = mean(on, denoise_ms), mean(off, denoise_ms)
        lines.append(
            f"| {what} | {rps_on / rps_off if rps_off else 0:.3f}x | {dn_off / dn_on if dn_on else 0:.3f}x |"
        )
    return "\n".join(lines)


def plot(results: list[RunResult], impls: list[str], out: Path, name: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib missing, no plots (pip install 'kvrelay[bench]')", file=sys.stderr)
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in impls:
        runs = [r for r in results if r.impl == impl]
        ax.plot([r.run + 1 for r in runs], [r.req_per_s for r in runs], marker="o", label=impl)
    # Runs are counted: whole numbers on the axis, one tick per run.
    run_numbers = sorted({r.run + 1 for r in results})
    ax.set_xticks(run_numbers)
    ax.set_xlim(min(run_numbers, default=1) - 0.5, max(run_numbers, default=1) + 0.5)
    ax.set_xlabel("run")
    ax.set_ylabel("req/s")
    ax.set_title(f"throughput per run ({name})")
    ax.legend()
    paths.append(out / f"{name}-throughput.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in impls:
        lat = sorted(x for r in results if r.impl == impl for x in r.latencies)
        if lat:
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=impl)
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("CDF")
    ax.set_title(f"request latency ({name})")
    ax.legend()
    paths.append(out / f"{name}-latency-cdf.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    phases = [
        "queue_seconds",
        "prefill_seconds",
        "transfer_seconds",
        "load_seconds",
        "denoise_seconds",
        "decode_seconds",
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(impls)
    for phase in phases:
        vals = []
        for impl in impls:
            means = [r.phase_means.get(phase, 0.0) for r in results if r.impl == impl]
            vals.append(statistics.mean(means) if means else 0.0)
        ax.bar(impls, vals, bottom=bottom, label=phase.removesuffix("_seconds"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("seconds per request (mean)")
    ax.set_title(f"phase breakdown ({name})")
    ax.legend(fontsize=7)
    paths.append(out / f"{name}-phases.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------


class BenchProgress:
    """Progress on stderr while `kvrelay bench` runs: requests done in the current run (a bar on a
    terminal, a line every ~10% otherwise) and, after every run, the results table so far."""

    def __init__(self, name: str, impls: list[str], runs: int, requests: int, stream: Any = None) -> None:
        self.name = name
        self.impls = impls
        self.runs = runs
        self.requests = requests
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.results: list[RunResult] = []
        self._bar: Any = None
        self._label = ""
        self._done = 0
        self._failed = 0
        self._started = 0.0

    def start_run(self, impl: str, run_idx: int, requests: int | None = None) -> None:
        self._label = f"bench[{self.name}] {impl} run {run_idx + 1}/{self.runs}"
        self.requests_now = requests if requests is not None else self.requests
        self._done = self._failed = 0
        self._started = time.perf_counter()
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=self.requests_now, desc=self._label, unit="req", file=self.stream, leave=False)
        else:
            print(f"{self._label}: {self.requests_now} requests", file=self.stream, flush=True)

    def request_done(self, record: RequestRecord) -> None:
        self._done += 1
        self._failed += 0 if record.ok else 1
        if self._bar is not None:
            self._bar.update(1)
            if self._failed:
                self._bar.set_postfix_str(f"{self._failed} failed")
            return
        step = max(1, self.requests_now // 10)
        if self._done % step == 0 or self._done == self.requests_now:
            elapsed = time.perf_counter() - self._started
            print(f"{self._label}: {self._done}/{self.requests_now} done, {self._failed} failed, "
                  f"{elapsed:.1f}s", file=self.stream, flush=True)  # fmt: skip

    def end_run(self, result: RunResult) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.results.append(result)
        print(
            f"{self._label}: {result.req_per_s:.4f} req/s, p50 {result.latency_p50:.3f}s, "
            f"p95 {result.latency_p95:.3f}s, {result.completed} done, {result.failed} failed",
            file=self.stream,
            flush=True,
        )
        done_runs = max(r.run for r in self.results) + 1
        print(seed_table(self.results, [i for i in self.impls if any(r.impl == i for r in self.results)],
                         done_runs), file=self.stream, flush=True)  # fmt: skip


def scenario_config(base: dict[str, Any], preset: str, max_num_seqs: int | None = None) -> dict[str, Any]:
    """`base` (a config as data) with the workload's preset on both stages (and `--max-num-seqs`);
    everything else of each stage's model (dtype, weight_seed, the DiT's quantization) is kept."""
    data: dict[str, Any] = json.loads(json.dumps(base))
    for stage in data["stages"]:
        model = dict(stage["model"])
        if model.get("format", "kvrelay") != "kvrelay":
            # A BAGEL-format model (the demo default) fixes its own shape: the workload's preset
            # replaces it, with random weights.
            model = {k: v for k, v in model.items() if k not in ("format", "path", "tokenizer")}
        stage["model"] = {**model, "preset": preset}
        if max_num_seqs:
            stage["max_num_seqs"] = max_num_seqs
    return data


def stop_all(nodes: list[Any]) -> None:
    """Stop every node at once (each waits out its services' stop graces: seconds apiece); the
    first error is raised once all of them stopped."""
    errors: list[BaseException] = []

    def stop(node: Any) -> None:
        try:
            node.stop()
        except BaseException as err:  # noqa: BLE001 - raised below, after every node stopped
            errors.append(err)

    threads = [threading.Thread(target=stop, args=(node,), name=f"bench-stop-{i}") for i, node in enumerate(nodes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def run_scenario(
    args: argparse.Namespace, workload: Workload, impls: list[str], base: dict[str, Any], workdir: Path
) -> dict[str, Any]:
    data = scenario_config(base, workload.preset, getattr(args, "max_num_seqs", None))
    nodes: dict[str, Any] = {}
    try:
        for impl in impls:
            print(f"bench[{workload.name}]: starting {impl} ...", file=sys.stderr, flush=True)
            if impl == "colocated":
                # The baseline runs where the DiT stage would: on its first device.
                nodes[impl] = ColocatedUnderTest.for_config(data, workload.preset)
            else:
                nodes[impl] = NodeUnderTest(impl, data, workdir, getattr(args, "ar_model", None))
        progress = BenchProgress(workload.name, impls, args.runs, args.requests)
        for impl, node in nodes.items():
            if args.warmup:
                print(f"bench[{workload.name}]: warming up {impl} ({args.warmup} requests)", file=sys.stderr,
                      flush=True)  # fmt: skip
                records, _, _ = node.run(workload, args.warmup, min(args.warmup, args.concurrency), run_idx=0)
                failed = [r.error for r in records if not r.ok]
                if failed:
                    raise RuntimeError(f"warm-up of {impl} failed: {failed[:3]}")
        results: list[RunResult] = []
        for run_idx in range(args.runs):
            # Interleaved: run k of every implementation before run k+1 of any.
            for impl in impls:
                progress.start_run(impl, run_idx)
                records, wall, moved = nodes[impl].run(
                    workload, args.requests, args.concurrency, run_idx, on_done=progress.request_done
                )
                results.append(summarize(impl, run_idx, records, wall, moved))
                results[-1].prefill_tokens_per_s = getattr(nodes[impl], "last_prefill_tokens_per_s", None)
                progress.end_run(results[-1])
    finally:
        stop_all(list(nodes.values()))
    return {
        "workload": {k: v for k, v in asdict(workload).items() if k != "prompts"},
        "results": [asdict(r) for r in results],
    }


def parse_impls(text: str) -> list[str]:
    """The implementations `--impls TEXT` names, in order; ValueError (one line naming each
    unknown name and the one it was meant to be, and every known one) for a list the bench cannot
    run: an unknown name, none at all (`--impls ,` ran an empty table), a name twice (its second
    node replaced the first, which was never stopped)."""
    impls = [i.strip() for i in text.split(",") if i.strip()]
    known = f"known: {', '.join(IMPL_LABELS)}"
    unknown = [i for i in impls if i not in IMPL_LABELS]
    if unknown:
        named = ", ".join(f"{i!r}{did_you_mean(i, IMPL_LABELS)}" for i in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise ValueError(f"--impls: unknown implementation{plural} {named}; {known}")
    if not impls:
        raise ValueError(f"--impls {text!r}: names no implementation; {known}")
    twice = sorted({i for i in impls if impls.count(i) > 1})
    if twice:
        raise ValueError(f"--impls {text}: names {', '.join(map(repr, twice))} more than once")
    return impls


def run(args: argparse.Namespace) -> int:
    try:
        impls = ["colocated"] if args.colocated else parse_impls(args.impls)
    except ValueError as err:
        print(f"kvrelay bench: {err}", file=sys.stderr)
        return 2
    if getattr(args, "dit_parallel", False):
        impls = list(DIT_LAYOUTS)
    if "colocated" in impls and getattr(args, "ar_model", None):
        print("kvrelay bench: --ar-model compares AR engines; the colocated baseline runs presets only", file=sys.stderr)
        return 2
    from kvrelay.models.presets import get_preset

    # Bad input is one line naming it and exit 2 before any node starts, never a traceback.
    try:
        base_cfg = load_config(args.config)
        base = base_cfg.model_dump(mode="json", exclude_none=True)
        preset = args.preset or base_cfg.ar_stage.model.preset or "small"
        get_preset(preset)
        scenario_base = scenario_config(base, preset, getattr(args, "max_num_seqs", None))
        for impl in impls:
            if impl == "colocated":
                continue
            # Every node's config is checked before the first starts (cuda_ipc on a CPU config,
            # vllm without --ar-model): not a traceback after minutes of the other nodes.
            try:
                parse_config(impl_config(impl, scenario_base, getattr(args, "ar_model", None)), f"bench-{impl}")
            except (ConfigError, ValueError) as err:
                raise ValueError(f"--impls {impl}: {err}") from None
        dataset = load_dataset(resolve(args.dataset, "data"))
        out = Path(args.output)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            # Was "file not found: /proc/nope", as if --output were an input.
            raise ValueError(f"--output {args.output}: cannot create the folder: {err.strerror or err}") from None
    except (ConfigError, ValueError, OSError) as err:
        print(f"kvrelay bench: {_input_error(err)}", file=sys.stderr)
        return 2
    # The nodes' supervisor logs on stderr (as under `kvrelay up`), so that stdout holds the
    # tables alone: unconfigured, structlog printed every child_started ... on stdout, among them.
    configure_logging(process="bench")
    scenarios = ["seed", "transfer"] if args.scenario == "both" else [args.scenario]
    report: dict[str, Any] = {"args": vars(args), "dataset_tokens": _token_stats(dataset), "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp:
        for name in scenarios:
            if name == "seed":
                workload = seed_workload(args, preset, dataset)
            else:
                workload = transfer_workload(dataset, preset, get_preset(preset).ar.max_tokens)
            scenario = run_scenario(args, workload, impls, base, Path(tmp))
            # The processes' own logs (per-request lines such as the DiT's `denoised`) outlive the
            # temporary folder: <output>/logs/<scenario>/<impl>-logs/<process>.log.
            for logs in sorted(Path(tmp).glob("*-logs")):
                shutil.copytree(logs, out / "logs" / name / logs.name, dirs_exist_ok=True)
            results = [RunResult(**r) for r in scenario["results"]]
            scenario["seed_table"] = seed_table(results, impls, args.runs)
            scenario["detail_table"] = detail_table(results)
            scenario["engine_table"] = engine_table(results)
            scenario["parallel_table"] = parallel_table(results)
            scenario["plots"] = [str(p) for p in plot(results, impls, out, name)]
            report["scenarios"][name] = scenario
            print(
                f"\n## scenario: {name} ({workload.preset}, {workload.width}x{workload.height}, {workload.steps} step(s), "
                f"guidance {workload.guidance_scale}, {args.runs} runs x {args.requests} requests, concurrency {args.concurrency})\n"
            )
            print(scenario["seed_table"])
            print()
            print(scenario["detail_table"])
            if scenario["engine_table"]:
                print()
                print(scenario["engine_table"])
            if scenario["parallel_table"]:
                print()
                print(scenario["parallel_table"])
            all_ok = all(r.failed == 0 for r in results)
            print(f"\nall requests completed: {all_ok}")
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\nbench: JSON and plots in {out}")
    return 0


def _token_stats(dataset: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = [int(r.get("prompt_tokens", 0)) for r in dataset]
    neg = [int(r.get("negative_prompt_tokens", 0)) for r in dataset]
    return {
        "prompt_tokens_min": min(tokens),
        "prompt_tokens_max": max(tokens),
        "prompt_tokens_mean": statistics.mean(tokens),
        "negative_prompt_tokens_mean": statistics.mean(neg),
    }
