"""Rank handlers for the multi-process BAGEL tests (importable by name for spawned ranks): the
AR prefills on its TP rank; the DiT gets its head shard of the prefix through a page pool, as in
the service, and denoises on its TP x SP rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay.models.bagel import build_ar
from kvrelay.models.bagel_runner import BagelDitRunner
from kvrelay.models.dit import shard_prefix
from kvrelay.models.paged_attention import LayerKv, read_prefix, write_prefix
from kvrelay.worker import RankContext

PAGE_SIZE = 4


@dataclass(frozen=True, slots=True)
class Prefill:
    ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class Denoise:
    full_rows: Sequence[Sequence[LayerKv]]
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int


@dataclass(frozen=True, slots=True)
class BagelRankFactory:
    directory: str
    stage: str  # "ar" | "dit"
    tp: int = 1
    sp: int = 1

    def __call__(self, ctx: RankContext) -> Any:
        return BagelRankHandler(ctx, self)


class BagelRankHandler:
    def __init__(self, ctx: RankContext, spec: BagelRankFactory) -> None:
        self.ctx = ctx
        if spec.stage == "ar":
            self.ar = build_ar(spec.directory, tp=ctx.tp, device=ctx.device)
        else:
            self.runner = BagelDitRunner(
                spec.directory, rank=ctx.rank, world=ctx.world_size, tp=spec.tp, sp=spec.sp, device=ctx.device
            )
            self.layout = self.runner.page_layout(PAGE_SIZE)

    def handle(self, command: Any) -> Any:
        if isinstance(command, Prefill):
            return self.ar.prefill(list(command.ids))
        assert isinstance(command, Denoise)
        rows = []
        for row in command.full_rows:
            n = row[0][0].shape[1]
            pages = self.layout.geometry.pages_for(n)
            pool = torch.zeros(self.layout.pool_bytes(pages + 1), dtype=torch.uint8)
            page_ids = list(range(1, pages + 1))[::-1]
            write_prefix(pool, self.layout, page_ids, shard_prefix(row, self.ctx.world_size, self.ctx.rank))
            rows.append([(k.clone(), v.clone()) for k, v in read_prefix(pool, self.layout, page_ids, n)])
        return self.runner.denoise(
            rows, width=command.width, height=command.height, steps=command.steps,
            guidance_scale=command.guidance_scale, seed=command.seed,
        )
