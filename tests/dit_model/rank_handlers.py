"""DiT rank handlers that the multi-process tests run inside real worker processes (importable by
name, so spawned ranks can unpickle the factory). Each rank receives its head shard of the prefix
the way the service will: written into its own page pool, then read back with read_prefix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.models import paged_attention
from kvrelay.models.dit import BatchRequest, DenoiseCancelled, DitRunner, StepAborted, shard_prefix
from kvrelay.models.moe import MoeMlp
from kvrelay.models.paged_attention import LayerKv, read_prefix, write_prefix
from kvrelay.worker import RankContext

PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class Generate:
    full_rows: Sequence[Sequence[LayerKv]]  # every kv head; each rank keeps its shard
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    stop_on_rank: int = -1  # this rank's step callback raises after `stop_after_step`
    stop_after_step: int = 0
    # Every rank passes an abort check (DitRunner.block_abort); this rank's says True from its
    # `abort_at_check`-th call on (the others' never do).
    abort_on_rank: int = -1
    abort_at_check: int = 0
    attention_chunk: int = 0  # > 0: paged_attention.ATTENTION_CHUNK in this rank's process


@dataclass(frozen=True, slots=True)
class GenerateBatch:
    """One denoise_batch over every item (same size and steps); answers each item's latents."""

    items: tuple[Generate, ...]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    latents: torch.Tensor
    image: torch.Tensor
    steps_seen: list[int]
    page_shard: int
    local_experts: int = 0  # routed experts this rank holds (MoE presets)


class StopRequested(Exception):
    """What the service's callback raises on cancel (any exception type must work)."""


@dataclass(frozen=True, slots=True)
class DitRankFactory:
    preset: str
    tp: int
    sp: int
    weight_seed: int
    expert_parallel: bool = False
    checkpoint: str | None = None
    force_gather: bool = False  # MoE: the all-gather fallback of gloo builds without alltoall
    cfg_parallel: int = 1  # world = cfg_parallel * tp * sp; CFG group c receives and computes row c

    def __call__(self, ctx: RankContext) -> DitRankHandler:
        return DitRankHandler(ctx, self)


class DitRankHandler:
    def __init__(self, ctx: RankContext, spec: DitRankFactory):
        self.ctx = ctx
        self.runner = DitRunner(
            spec.preset,
            rank=ctx.rank,
            world=ctx.world_size,
            tp=spec.tp,
            sp=spec.sp,
            weight_seed=spec.weight_seed,
            device=ctx.device,
            expert_parallel=spec.expert_parallel,
            checkpoint=spec.checkpoint,
            cfg_parallel=spec.cfg_parallel,
        )
        if spec.force_gather:
            from kvrelay.models import moe

            moe._alltoall_unsupported = True
        self.layout = self.runner.page_layout(PAGE_SIZE)

    def _rows_through_pages(self, full_rows: Sequence[Sequence[LayerKv]]) -> list[list[LayerKv]]:
        pages_per_row = [self.layout.geometry.pages_for(row[0][0].shape[1]) for row in full_rows]
        pool = torch.zeros(
            self.layout.pool_bytes(sum(pages_per_row) + 1), dtype=torch.uint8, device=self.runner.device
        )
        rows, next_page = [], 1  # page 0 left unused so no row starts at offset 0 by accident
        for row, n in zip(full_rows, pages_per_row, strict=True):
            page_ids = list(range(next_page, next_page + n))[::-1]  # reversed: a non-contiguous gather
            next_page += n
            shard = shard_prefix(row, self.runner.parallel.world, self.runner.parallel.rank)
            write_prefix(
                pool, self.layout, page_ids, [(k.to(pool.device), v.to(pool.device)) for k, v in shard]
            )
            rows.append(read_prefix(pool, self.layout, page_ids, row[0][0].shape[1]))
        return rows

    def _my_rows(self, command: Generate) -> list[Sequence[LayerKv]]:
        # A CFG-parallel group's ranks receive only their rows' KV (none for group 1 of a one-row request).
        return [command.full_rows[r] for r in self.runner.local_rows(command.guidance_scale)]

    def handle(self, command: Generate | GenerateBatch) -> GenerateResult | list[torch.Tensor | None]:
        if isinstance(command, GenerateBatch):
            return self._batch(command)
        return self._one(command)

    def _batch(self, command: GenerateBatch) -> list[torch.Tensor | None]:
        first = command.items[0]
        requests = [
            BatchRequest(self._rows_through_pages(self._my_rows(c)), c.guidance_scale, c.seed) for c in command.items
        ]
        out = self.runner.denoise_batch(requests, width=first.width, height=first.height, steps=first.steps)
        return [None if x is None else x.cpu() for x in out]

    def _one(self, command: Generate) -> GenerateResult:
        seen: list[int] = []

        def on_step(step: int, total: int) -> None:
            seen.append(step)
            if self.ctx.rank == command.stop_on_rank and step == command.stop_after_step:
                raise StopRequested(f"rank {self.ctx.rank} stops after step {step}/{total}")

        rows = self._rows_through_pages(self._my_rows(command))
        checks: list[int] = []
        if command.attention_chunk:
            paged_attention.ATTENTION_CHUNK = command.attention_chunk

        def abort() -> bool:
            checks.append(1)
            return self.ctx.rank == command.abort_on_rank and len(checks) >= command.abort_at_check

        try:
            latents = self.runner.denoise(
                rows,
                width=command.width,
                height=command.height,
                steps=command.steps,
                guidance_scale=command.guidance_scale,
                seed=command.seed,
                on_step=on_step,
                abort=abort if command.abort_on_rank >= 0 else None,
            )
        except Exception as err:
            # Carry what this rank saw, so the test can check where every rank stopped.
            info = f"[steps_seen={seen}] [checks={len(checks)}] [last_abort={self.runner.last_abort}]"
            if isinstance(err, StepAborted):  # its constructor takes the block, not a message
                raise DenoiseCancelled(f"StepAborted: {err} {info}") from None
            raise type(err)(f"{err} {info}") from None
        experts = [m.experts.w_gate_up.shape[0] for m in self.runner.model.modules() if isinstance(m, MoeMlp)]
        return GenerateResult(
            latents.cpu(), self.runner.decode(latents), seen, self.layout.shard, experts[0] if experts else 0
        )
