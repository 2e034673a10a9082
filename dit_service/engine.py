"""The DiT rank handler: what runs inside each rank worker process of a DiT replica.

Owns, per rank: the mapping of its host page pool (shared with the service process), its
transport registration (Mooncake: one TransferEngine per rank process, the pool registered once
for the process lifetime), the device pool and mirror -> device copy when the model runs on a GPU,
checksum verification of the writes that target this rank, and its share of the DiT (TP heads or
Ulysses SP tokens). Rank 0 decodes the latents and hands the pixels back (the service process
encodes the PNG off the ranks' critical path).

It never talks to the broker and never decides when pages are free: the service process does,
after the rank has answered. Step progress and cancellation cross a small shared control block
(not the command pipe, which carries one reply per command) so the service can stream steps and
stop a denoise: on the CPU at the next transformer block once every request of the running batch
is cancelled (the ranks agree on the block, `DitRunner.block_abort`), else at the next step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvrelay.dit_service.memory import HostPool, PoolSpec
from kvrelay.transfer.checksum import checksum_segments
from kvrelay.transfer.planner import PlannedWrite, RowSpec
from kvrelay.transfer.transport import RegionDescriptor
from kvrelay.worker import RankContext

if TYPE_CHECKING:
    from kvrelay.config import StageConfig

# Control block: one row of int64 per slot: [steps done, cancel requested, sequence number].
CONTROL_FIELDS = 3
STEP, CANCEL, SERIAL = 0, 1, 2


def control_bytes(slots: int) -> int:
    return slots * CONTROL_FIELDS * 8


# ---------------------------------------------------------------------------------------------
# Commands (sent to every rank in the same order; frozen so they pickle cheaply)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DescribeRegion:
    """Register this rank's pool with its transport (once) and describe it. None for the gRPC
    fallback, whose regions the service process describes (it receives the chunks)."""


@dataclass(frozen=True, slots=True)
class VerifyWrites:
    """Checksum the destination bytes of `writes` (this rank's share) in segment order."""

    writes: tuple[PlannedWrite, ...]


@dataclass(frozen=True, slots=True)
class RunDenoise:
    slot: int
    serial: int
    rows: tuple[RowSpec, ...]
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int


@dataclass(frozen=True, slots=True)
class RunDenoiseBatch:
    """Denoise several admitted requests together (same size and step count): one forward per
    step over all their CFG rows. Answers one DenoiseResult per item, in order; an item whose
    slot is cancelled stops at the next step boundary while the others go on; once every item is
    cancelled, a CPU step stops at its next transformer block."""

    items: tuple[RunDenoise, ...]


@dataclass(frozen=True, slots=True)
class DenoiseResult:
    rank: int
    steps_done: int
    cancelled: bool
    # Rank 0's decoded image, uint8 RGB [H, W, 3] (numpy) on the host. The service process encodes
    # the PNG in a thread after the slot is released: the CPU encode never idles the GPU.
    pixels: Any | None
    width: int
    height: int
    copy_seconds: float
    denoise_seconds: float
    decode_seconds: float
    # How long this rank sat without a denoise command before this one arrived (since its
    # previous denoise returned; 0 for the first): the replica's own dispatch overhead when
    # requests were queued, idle time otherwise.
    idle_seconds: float = 0.0
    # (step, block, attention chunk) where the ranks abandoned a step mid-way because every request
    # of the batch was cancelled (CPU, `DitRunner.block_abort`); None when the denoise stopped at a
    # step boundary or ran to the end.
    aborted_at: tuple[int, int, int] | None = None


class DenoiseStopped(Exception):
    """The service asked this denoise to stop (its caller cancelled)."""


# ---------------------------------------------------------------------------------------------
# Factory (picklable) and handler
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DitRankSpec:
    """Everything a rank needs to build itself; pickled into the spawned worker."""

    preset: str
    weight_seed: int
    dtype: str | None
    tp: int
    sp: int
    page_size: int
    num_pages: int
    pools: tuple[PoolSpec, ...]
    control: PoolSpec
    slots: int
    transport: str
    mooncake_host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    mooncake_device_name: str = ""
    # A directory written by DitRunner.save_checkpoint; None = random weights from weight_seed.
    checkpoint: str | None = None
    # "kvrelay" (DitRunner over a preset) or "bagel" / "demo" (BagelDitRunner over `checkpoint`).
    model_format: str = "kvrelay"
    # `enable_expert_parallel`: a MoE preset's experts sharded over the TP group (models/moe.py).
    expert_parallel: bool = False
    # `cfg_parallel_size`: the ranks form this many groups of tp * sp; group g reads and computes
    # CFG row g only (its pages hold no other row).
    cfg_parallel: int = 1
    # `model.quantization`: "fp8" = the DiT's big linears as FP8 GEMMs (kvrelay.models.fp8): the
    # built-in blocks', or a BAGEL-format DiT's generation expert's.
    quantization: str | None = None

    @classmethod
    def for_stage(
        cls, stage: StageConfig, *, preset: str, checkpoint: str | None, num_pages: int,
        pools: tuple[PoolSpec, ...], control: PoolSpec, slots: int,
    ) -> DitRankSpec:
        """The spec of one replica of the DiT `stage` (what `kvrelay dit` starts its ranks with):
        the model and parallel layout from the config, the memory the service process made."""
        return cls(
            preset=preset, weight_seed=stage.model.weight_seed, dtype=stage.model.dtype, checkpoint=checkpoint,
            model_format=stage.model.format, quantization=stage.model.quantization,
            tp=stage.tensor_parallel_size, sp=stage.sequence_parallel_size, page_size=stage.page_size,
            num_pages=num_pages, pools=pools, control=control, slots=slots, transport=stage.transport,
            mooncake_host=stage.advertise_host, mooncake_protocol=stage.mooncake_protocol,
            mooncake_device_name=str(stage.extra.get("device_name", "")),
            expert_parallel=stage.enable_expert_parallel, cfg_parallel=stage.cfg_parallel_size,
        )

    def __call__(self, ctx: RankContext) -> DitRankHandler:
        return DitRankHandler(ctx, self)


class DitRankHandler:
    def __init__(self, ctx: RankContext, spec: DitRankSpec) -> None:
        import numpy as np
        import torch

        from kvrelay.models.dit import DitRunner
        from kvrelay.models.layers import torch_dtype

        self.ctx = ctx
        self.spec = spec
        self._torch = torch
        device = torch.device(ctx.device)
        dtype = torch_dtype(spec.dtype) if spec.dtype else None
        if spec.model_format in ("bagel", "demo"):
            from kvrelay.models.bagel_runner import BagelDitRunner

            if spec.cfg_parallel != 1:
                raise ValueError(f"cfg_parallel={spec.cfg_parallel}: the {spec.model_format} runner has no CFG-parallel")
            assert spec.checkpoint is not None
            self.runner: Any = BagelDitRunner(
                spec.checkpoint, rank=ctx.rank, world=ctx.world_size, tp=spec.tp, sp=spec.sp,
                device=device, dtype=dtype, quantization=spec.quantization,
            )
        else:
            self.runner = DitRunner(
                spec.preset, rank=ctx.rank, world=ctx.world_size, tp=spec.tp, sp=spec.sp,
                weight_seed=spec.weight_seed, device=device, dtype=dtype, checkpoint=spec.checkpoint,
                expert_parallel=spec.expert_parallel, cfg_parallel=spec.cfg_parallel,
                quantization=spec.quantization,
            )
        self.layout = self.runner.page_layout(spec.page_size)
        self.runner.warm_up()  # GPU: compile and capture before the replica reports SERVING
        pool_spec = spec.pools[ctx.rank]
        if pool_spec.num_bytes != self.layout.pool_bytes(spec.num_pages):
            raise ValueError(
                f"rank {ctx.rank}: pool of {pool_spec.num_bytes} bytes does not hold {spec.num_pages} pages "
                f"of {self.layout.page_bytes} bytes: the service and the model disagree on the layout"
            )
        self.host = HostPool.attach(pool_spec)
        self.host_tensor = self.host.tensor()
        self.control_pool = HostPool.attach(spec.control)
        self.control = np.frombuffer(self.control_pool.buffer, dtype=np.int64).reshape(spec.slots, CONTROL_FIELDS)
        self._pinned = False
        self.device_pool = None
        # CUDA IPC: the AR writes straight into the device pool (device-resident pages, no mirror
        # copy at load, checksums on the device).
        self.device_resident = spec.transport == "cuda_ipc"
        if self.device_resident and device.type != "cuda":
            raise ValueError(f"rank {ctx.rank}: CudaIpcConnector needs the DiT on a GPU, got {device}")
        if device.type == "cuda":
            if not self.device_resident:
                # Mooncake and gRPC write host memory: the host pool is the pinned mirror; pages
                # are copied to the device pool for the ticket being loaded.
                self._pin_mirror()
            self.device_pool = torch.zeros(pool_spec.num_bytes, dtype=torch.uint8, device=device)
        self._endpoint: Any = None
        self._region: RegionDescriptor | None = None
        self._denoise_returned: float | None = None  # perf_counter when the last denoise returned

    def _pin_mirror(self) -> None:
        torch = self._torch
        try:
            rc = torch.cuda.cudart().cudaHostRegister(self.host_tensor.data_ptr(), self.host_tensor.numel(), 0)
            self._pinned = int(rc) == 0
        except Exception:  # noqa: BLE001 - pinning is a speed-up; pageable copies stay correct
            self._pinned = False

    # -- commands -------------------------------------------------------------------------------

    def handle(self, command: Any) -> Any:
        if isinstance(command, DescribeRegion):
            return self._describe()
        if isinstance(command, VerifyWrites):
            return self._verify(command.writes)
        if isinstance(command, RunDenoise | RunDenoiseBatch):
            arrived = time.perf_counter()
            idle = 0.0 if self._denoise_returned is None else arrived - self._denoise_returned
            try:
                if isinstance(command, RunDenoise):
                    return replace(self._denoise(command), idle_seconds=idle)
                return tuple(replace(r, idle_seconds=idle) for r in self._denoise_batch(command))
            finally:
                self._denoise_returned = time.perf_counter()
        raise TypeError(f"DiT rank {self.ctx.rank} got an unknown command {type(command).__name__}")

    def _describe(self) -> RegionDescriptor | None:
        if self.device_resident:
            if self._region is None:
                from kvrelay.transfer.transport import make_receiver

                self._endpoint = make_receiver("cuda_ipc", device=str(self.device_pool.device))
                self._region = self._endpoint.register_region(self.device_pool, self.ctx.rank)
            return self._region
        if self.spec.transport != "mooncake":
            return None
        if self._region is None:
            from kvrelay.transfer.mooncake import endpoint

            self._endpoint = endpoint(self.spec.mooncake_host, self.spec.mooncake_protocol, self.spec.mooncake_device_name)
            self._region = self._endpoint.register_region(self.host_tensor, self.ctx.rank)
        return self._region

    def _verify(self, writes: Sequence[PlannedWrite]) -> list[int]:
        for w in writes:
            if w.dst_rank != self.ctx.rank:
                raise ValueError(f"rank {self.ctx.rank} asked to verify a write for rank {w.dst_rank}")
        if self.device_resident:
            # The transport's own checksum, computed where the bytes are (no host copy).
            from kvrelay.transfer.cuda_ipc import verify_writes

            return verify_writes(self.device_pool, writes)
        return [checksum_segments(self.host_tensor, w.segments, side="dst") for w in writes]

    def _load_to_device(self, rows: Sequence[RowSpec]) -> float:
        if self.device_pool is None or self.device_resident:
            return 0.0
        start = time.perf_counter()
        page_bytes = self.layout.page_bytes
        for row in rows:
            for page in row.page_ids:
                lo, hi = page * page_bytes, (page + 1) * page_bytes
                self.device_pool[lo:hi].copy_(self.host_tensor[lo:hi], non_blocking=self._pinned)
        self._torch.cuda.synchronize(self.device_pool.device)
        return time.perf_counter() - start

    def _my_rows(self, cmd: RunDenoise) -> list[RowSpec]:
        """The rows this rank reads: all of them, or on a CFG-parallel replica only its group's
        (the other group's page ids are another group's pages: reading them here would be garbage)."""
        if self.spec.cfg_parallel == 1:
            return list(cmd.rows)
        wanted = set(self.runner.local_rows(cmd.guidance_scale))
        return [row for row in cmd.rows if row.row in wanted]

    def _denoise(self, cmd: RunDenoise) -> DenoiseResult:
        from kvrelay.models.dit import DenoiseCancelled
        from kvrelay.models.paged_attention import read_prefix

        control = self.control[cmd.slot]
        rows = self._my_rows(cmd)
        copy_seconds = self._load_to_device(rows)
        pool = self.device_pool if self.device_pool is not None else self.host_tensor
        prefix_rows = [read_prefix(pool, self.layout, row.page_ids, row.num_tokens) for row in rows]
        steps_done = 0

        def on_step(step: int, total: int) -> None:
            nonlocal steps_done
            steps_done = step
            if self.ctx.rank == 0 and int(control[SERIAL]) == cmd.serial:
                control[STEP] = step
            # Every rank checks; DitRunner's vote makes all ranks stop after the same step.
            if int(control[SERIAL]) == cmd.serial and int(control[CANCEL]):
                raise DenoiseStopped(f"cancelled after step {step}/{total}")

        start = time.perf_counter()
        try:
            if int(control[SERIAL]) == cmd.serial and int(control[CANCEL]):
                raise DenoiseStopped("cancelled before the first step")
            latents = self.runner.denoise(
                prefix_rows, width=cmd.width, height=cmd.height, steps=cmd.steps,
                guidance_scale=cmd.guidance_scale, seed=cmd.seed, on_step=on_step,
                **self._abort_kw(lambda: self._cancelled(cmd)),
            )
        except (DenoiseStopped, DenoiseCancelled):
            return DenoiseResult(self.ctx.rank, steps_done, True, None, cmd.width, cmd.height,
                                 copy_seconds, time.perf_counter() - start, 0.0,
                                 aborted_at=getattr(self.runner, "last_abort", None))
        finally:
            del prefix_rows  # views into the pool: none outlives the call
        self._sync()  # the steps are queued asynchronously (graph replays): time what they cost
        denoise_seconds = time.perf_counter() - start
        pixels, decode_seconds = None, 0.0
        if self.ctx.rank == 0:
            start = time.perf_counter()
            pixels = self._pixels(latents)
            decode_seconds = time.perf_counter() - start
        return DenoiseResult(self.ctx.rank, steps_done, False, pixels, cmd.width, cmd.height,
                             copy_seconds, denoise_seconds, decode_seconds)

    def _sync(self) -> None:
        if self.device_pool is not None:
            self._torch.cuda.synchronize(self.device_pool.device)

    def _pixels(self, latents: Any) -> Any:
        """The decoded image as a host uint8 [H, W, 3] array (what the PNG encoder takes)."""
        import numpy as np

        image = self.runner.decode(latents)
        array = image.detach().cpu().numpy() if hasattr(image, "detach") else np.asarray(image)
        return np.ascontiguousarray(array)

    def _abort_kw(self, abort: Any) -> dict[str, Any]:
        """`abort=` for a runner that can stop a step at a block boundary (`DitRunner`; a
        BAGEL-format runner stops at step boundaries only)."""
        from kvrelay.models.dit import DitRunner

        return {"abort": abort} if isinstance(self.runner, DitRunner) else {}

    def _cancelled(self, cmd: RunDenoise) -> bool:
        control = self.control[cmd.slot]
        return int(control[SERIAL]) == cmd.serial and bool(int(control[CANCEL]))

    def _denoise_batch(self, cmd: RunDenoiseBatch) -> tuple[DenoiseResult, ...]:
        from kvrelay.models.dit import BatchRequest
        from kvrelay.models.paged_attention import read_prefix

        items = cmd.items
        if not items:
            return ()
        first = items[0]
        if any((c.width, c.height, c.steps) != (first.width, first.height, first.steps) for c in items):
            raise ValueError("a denoise batch needs one image size and step count")
        mine = [self._my_rows(c) for c in items]
        copy_seconds = self._load_to_device([row for rows in mine for row in rows])
        pool = self.device_pool if self.device_pool is not None else self.host_tensor
        steps_done = [0] * len(items)
        # Cancelled before the first step: never part of the batch.
        running = [i for i, c in enumerate(items) if not self._cancelled(c)]
        requests = [
            BatchRequest([read_prefix(pool, self.layout, row.page_ids, row.num_tokens) for row in mine[i]],
                         items[i].guidance_scale, items[i].seed)
            for i in running
        ]

        def on_step(step: int, total: int, active: list[int]) -> set[int]:
            stop = set()
            for j in active:
                c = items[running[j]]
                steps_done[running[j]] = step
                if self.ctx.rank == 0 and int(self.control[c.slot][SERIAL]) == c.serial:
                    self.control[c.slot][STEP] = step
                if self._cancelled(c):
                    stop.add(j)
            return stop

        def abort(active: list[int]) -> bool:
            # Only once every request still in the batch is cancelled: a live one's rows must
            # never see a partial step (a cancelled one among live ones stops at the step's end).
            return all(self._cancelled(items[running[j]]) for j in active)

        start = time.perf_counter()
        latents = self.runner.denoise_batch(requests, width=first.width, height=first.height, steps=first.steps,
                                            on_step=on_step, **self._abort_kw(abort)) if requests else []
        aborted_at = getattr(self.runner, "last_abort", None) if requests else None
        del requests  # views into the pool: none outlives the call
        self._sync()
        denoise_seconds = time.perf_counter() - start
        out: list[DenoiseResult | None] = [None] * len(items)
        for j, i in enumerate(running):
            c = items[i]
            if latents[j] is None:
                continue
            pixels, decode_seconds = None, 0.0
            if self.ctx.rank == 0:
                t0 = time.perf_counter()
                pixels = self._pixels(latents[j])
                decode_seconds = time.perf_counter() - t0
            out[i] = DenoiseResult(self.ctx.rank, steps_done[i], False, pixels, c.width, c.height, copy_seconds,
                                   denoise_seconds, decode_seconds)
        return tuple(
            r if r is not None else DenoiseResult(self.ctx.rank, steps_done[i], True, None, items[i].width,
                                                  items[i].height, copy_seconds, denoise_seconds, 0.0,
                                                  aborted_at=aborted_at if i in running else None)
            for i, r in enumerate(out)
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister from the transport, then unmap. Called by the harness on Stop; the service
        frees (unlinks) the pools only after every rank has exited."""
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
        if self._pinned:
            try:
                self._torch.cuda.cudart().cudaHostUnregister(self.host_tensor.data_ptr())
            except Exception:  # noqa: BLE001 - the process is exiting; the mapping goes with it
                pass
            self._pinned = False
        self.control = None  # type: ignore[assignment]
        self.host_tensor = None
        self.host.close()
        self.control_pool.close()
