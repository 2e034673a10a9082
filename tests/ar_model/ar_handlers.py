"""AR prefill on worker ranks, for the harness-driven AR tests (importable by spawned ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.models.ar import build_ar_model
from kvrelay.worker import RankContext


@dataclass(frozen=True, slots=True)
class Prefill:
    token_ids: tuple[int, ...]


class ArPrefillHandler:
    def __init__(
        self,
        ctx: RankContext,
        *,
        preset: str = "tiny",
        seed: int = 0,
        path: str | None = None,
        dtype: str | None = None,
    ):
        if path is not None:
            self.model = build_ar_model(path=path, tp=ctx.tp, device=ctx.device, dtype=dtype)
        else:
            self.model = build_ar_model(preset=preset, seed=seed, tp=ctx.tp, device=ctx.device, dtype=dtype)

    def handle(self, command: object) -> torch.Tensor:
        if isinstance(command, Prefill):
            return self.model.prefill(list(command.token_ids))
        raise TypeError(f"unknown command {command!r}")
