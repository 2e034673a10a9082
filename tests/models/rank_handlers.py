"""Rank handlers that the harness tests run inside real worker processes (importable by name,
so spawned ranks can unpickle the factories)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from kvrelay.models.layers import ParallelAttention, RMSNorm, SwiGLU, rope_cos_sin
from kvrelay.models.parallel import ColumnParallelLinear, RowParallelLinear, TpGroup, new_subgroups
from kvrelay.models.ulysses import _all_to_all_by_gather, heads_to_seq, seq_to_heads, shard_sequence
from kvrelay.worker import RankContext

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 8, 4, 8


def _full(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) / shape[-1] ** 0.5


def build_linear_stack(tp: TpGroup, seed: int) -> torch.nn.ModuleList:
    """column -> row -> column(gathered): every weight generated whole from the seed, then sharded."""
    layers = torch.nn.ModuleList(
        [
            ColumnParallelLinear(HIDDEN, MLP, tp, bias=True),
            RowParallelLinear(MLP, HIDDEN, tp, bias=True),
            ColumnParallelLinear(HIDDEN, MLP, tp, gather_output=True),
        ]
    )
    for i, layer in enumerate(layers):
        w = _full(seed + i, layer.out_features, layer.in_features)
        b = _full(seed + 100 + i, 1, layer.out_features)[0] if layer.bias is not None else None
        layer.load_full(w, b)
    return layers


def run_linear_stack(tp: TpGroup, seed: int, x: torch.Tensor) -> torch.Tensor:
    stack = build_linear_stack(tp, seed)
    h = torch.relu(stack[0](x))
    h = stack[1](h)
    return stack[2](h)


def run_attention_block(tp: TpGroup, seed: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm attention + SwiGLU block; returns (output, this rank's K after RoPE)."""
    attn = ParallelAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, tp, qkv_bias=True)
    mlp = SwiGLU(HIDDEN, MLP, tp)
    norm = RMSNorm(HIDDEN)
    for i, layer in enumerate(
        [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    ):
        bias = _full(seed + 50 + i, 1, layer.out_features)[0] if layer.bias is not None else None
        layer.load_full(_full(seed + i, layer.out_features, layer.in_features), bias)
    cos, sin = rope_cos_sin(torch.arange(x.shape[1]), HEAD_DIM, 10000.0)
    out, k, _ = attn(norm(x), cos, sin, causal=True)
    h = x + out
    return h + mlp(norm(h)), k


@dataclass(frozen=True, slots=True)
class LinearStack:
    seed: int
    x: torch.Tensor


@dataclass(frozen=True, slots=True)
class AttentionBlock:
    seed: int
    x: torch.Tensor


@dataclass(frozen=True, slots=True)
class UlyssesRoundTrip:
    full: torch.Tensor  # [B, H, T, D], same on every rank


@dataclass(frozen=True, slots=True)
class Explode:
    message: str


@dataclass(frozen=True, slots=True)
class ExitNow:
    code: int


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Info:
    pass


@dataclass(frozen=True, slots=True)
class WedgeCommandLoop:
    """Answer, then leave the next command unread for `seconds`: the rank's command loop hangs
    while its liveness beat (a thread of its own) runs on, as a rank stuck outside any command."""

    seconds: float


@dataclass(frozen=True, slots=True)
class SubgroupSums:
    group_size: int
    strided: bool


class ModelsTestHandler:
    def __init__(self, ctx: RankContext):
        self.ctx = ctx

    def handle(self, command: object) -> object:
        tp = self.ctx.tp
        if isinstance(command, LinearStack):
            return run_linear_stack(tp, command.seed, command.x)
        if isinstance(command, AttentionBlock):
            return run_attention_block(tp, command.seed, command.x)
        if isinstance(command, UlyssesRoundTrip):
            local = shard_sequence(command.full, dim=-2, group=tp)
            by_heads = seq_to_heads(local, tp)
            back = heads_to_seq(by_heads, tp)
            # The fallback for gloo builds without alltoall must route chunks identically.
            chunks = list(local.chunk(tp.world_size, dim=-3))
            by_gather = torch.cat(_all_to_all_by_gather(chunks, tp), dim=-2)
            return local, by_heads, back, by_gather
        if isinstance(command, Explode):
            raise ValueError(command.message)
        if isinstance(command, ExitNow):
            os._exit(command.code)
        if isinstance(command, Sleep):
            time.sleep(command.seconds)
            return None
        if isinstance(command, SubgroupSums):
            sub = new_subgroups(tp.rank, tp.world_size, command.group_size, strided=command.strided)
            total = sub.all_reduce(torch.tensor([float(10**tp.rank)]))
            return sub.rank, sub.world_size, float(total)
        if isinstance(command, WedgeCommandLoop):
            import kvrelay.worker as harness

            receive = harness._recv

            def wedged(conn: object) -> object:
                harness._recv = receive
                time.sleep(command.seconds)
                return receive(conn)

            harness._recv = wedged
            return None
        if isinstance(command, Info):
            return (os.getpid(), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"),
                    os.environ.get("OMP_WAIT_POLICY"))
        raise TypeError(f"unknown command {command!r}")


def failing_factory(ctx: RankContext) -> ModelsTestHandler:
    if ctx.rank == 1:
        raise RuntimeError("rank 1 cannot load its weights")
    return ModelsTestHandler(ctx)
