"""Seconds per denoising step through the DiT service (docs/dit_service.md quotes its output).

    .venv/bin/python -m tests.dit_service.measure_step_time --preset small --size 512 --steps 4

Starts a real broker core in this process and a real `python -m kvrelay dit` process, moves a
seeded CFG prefix (2 rows) over Mooncake TCP, runs one Denoise and prints the step times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc

from kvrelay.v1 import dit_pb2, dit_pb2_grpc
from tests.dit_service.harness import ArWriter, inprocess_broker, start_dit, wait_serving, write_config


async def measure(preset: str, size: int, steps: int, tp: int, sp: int, guidance: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        config = write_config(tmp_path, transport="mooncake", preset=preset, tp=tp, sp=sp,
                              kv_cache_memory_bytes=64 << 20, transfer_timeout=30.0)
        async with inprocess_broker() as (broker, _core):
            dit = start_dit(config, broker.address, cwd=tmp_path)
            try:
                await wait_serving(dit, timeout=300.0)
                writer = ArWriter(broker.address, preset, "mooncake")
                await writer.register()
                counts = [24, 1] if guidance > 1.0 else [24]
                ticket = await writer.written_ticket(counts, seed=0)
                stamps: list[float] = []
                async with grpc.aio.insecure_channel(dit.address) as channel:
                    call = dit_pb2_grpc.DitServiceStub(channel).Denoise(dit_pb2.DenoiseRequest(
                        ticket_id=ticket.ticket_id, width=size, height=size, num_inference_steps=steps,
                        guidance_scale=guidance, seed=0), timeout=3600.0)
                    async for event in call:
                        stamps.append(time.perf_counter())
                        if event.phase == dit_pb2.DENOISE_PHASE_DECODED:
                            final = event
                step_gaps = [b - a for a, b in zip(stamps[1:-2], stamps[2:-1], strict=True)]
                await writer.close()
                return {
                    "preset": preset, "size": size, "steps": steps, "tp": tp, "sp": sp, "cfg_rows": len(counts),
                    # The first step pays one-off allocations; the steady state is what a server sees.
                    "seconds_per_step_mean": round(final.denoise_seconds / steps, 4),
                    "first_step_seconds": round(step_gaps[0], 4),
                    "steady_seconds_per_step": round(sum(step_gaps[1:]) / max(1, len(step_gaps) - 1), 4),
                    "step_event_gaps": [round(g, 4) for g in step_gaps],
                    "load_seconds": round(final.load_seconds, 4),
                    "decode_seconds": round(final.decode_seconds, 4),
                    "png_bytes": len(final.image.png),
                }
            finally:
                await asyncio.to_thread(dit.stop)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--guidance-scale", type=float, default=2.0)
    a = p.parse_args()
    print(json.dumps(asyncio.run(measure(a.preset, a.size, a.steps, a.tp, a.sp, a.guidance_scale))))


if __name__ == "__main__":
    main()
