"""Megatron-style tensor parallelism over torch.distributed.

Owns: the `TpGroup` (this rank's place in its tensor parallel group), process group start-up
(backend choice: gloo on CPU, NCCL on CUDA, gloo when two ranks share one GPU, since NCCL refuses
two ranks on one device) and the column/row parallel linear layers. Everything works in a single
process with world size 1, where the collectives are no-ops, so models have one code path.
Never starts processes: the rank worker harness (kvrelay/worker.py) does that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kvrelay.models.fp8 import linear, quantize_into, quantize_source_

# The choice lives beside the harness, which makes it in the service process (no torch there).
from kvrelay.worker import choose_backend as choose_backend


@dataclass(frozen=True, slots=True)
class TpGroup:
    """This rank's view of its tensor parallel group. `group=None` means the default (world) group."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @classmethod
    def single(cls) -> TpGroup:
        return cls(0, 1, None)

    @classmethod
    def from_default_group(cls) -> TpGroup:
        if not dist.is_available() or not dist.is_initialized():
            return cls.single()
        return cls(dist.get_rank(), dist.get_world_size(), None)

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` items (heads, features)."""
        if total % self.world_size:
            raise ValueError(f"{total} does not split evenly over tensor parallel size {self.world_size}")
        per = total // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of a full tensor along `dim` (a copy, so the full tensor
        can be freed)."""
        start, end = self.shard_range(tensor.shape[dim])
        return tensor.narrow(dim, start, end - start).contiguous()

    def stages_through_host(self, tensor: torch.Tensor) -> bool:
        """True when `tensor` is on a GPU but the group is gloo (ranks sharing one GPU): gloo's
        CUDA support does not cover every collective, so those go through host memory."""
        return tensor.is_cuda and dist.get_backend(self.group) == "gloo"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `tensor`."""
        if self.world_size > 1:
            if self.stages_through_host(tensor):
                host = tensor.cpu()
                dist.all_reduce(host, op=dist.ReduceOp.SUM, group=self.group)
                tensor.copy_(host)
            else:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim` in rank order."""
        if self.world_size == 1:
            return tensor
        if self.stages_through_host(tensor):
            return self.all_gather(tensor.cpu(), dim).to(tensor.device)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def init_process_group(
    rank: int,
    world_size: int,
    init_address: str,
    *,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 120.0,
) -> TpGroup:
    """Join the default process group at `init_address` ("tcp://host:port") and return its TpGroup.

    World size 1 starts no process group at all: the TpGroup's collectives are no-ops there.
    """
    if world_size == 1:
        return TpGroup.single()
    if backend == "gloo" and ("127.0.0.1" in init_address or "localhost" in init_address):
        # gloo otherwise binds the interface that the hostname resolves to, which in containers is
        # often unreachable from the other ranks; every rank of a replica runs on this host.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend=backend,
        init_method=init_address,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    return TpGroup(rank, world_size, None)


def new_subgroups(rank: int, world_size: int, group_size: int, *, strided: bool = False) -> TpGroup:
    """Split the world into groups of `group_size` ranks and return this rank's (e.g. TP groups
    inside a TP x SP DiT). Contiguous: {0..g-1}, {g..2g-1}, ...; strided: {0, n, 2n, ...},
    {1, n+1, ...} with n = world_size / group_size. Every rank must call this with the same
    arguments (process groups are created collectively, all of them on every rank)."""
    if world_size % group_size:
        raise ValueError(f"group size {group_size} does not divide world size {world_size}")
    if group_size == world_size:
        return TpGroup(rank, world_size, None)
    num_groups = world_size // group_size
    mine: TpGroup | None = None
    for g in range(num_groups):
        if strided:
            ranks = list(range(g, world_size, num_groups))
        else:
            ranks = list(range(g * group_size, (g + 1) * group_size))
        # new_group is collective over the world even for ranks outside the new group.
        handle = dist.new_group(ranks) if group_size > 1 else None
        if rank in ranks:
            mine = TpGroup(ranks.index(rank), group_size, handle)
    assert mine is not None
    return mine


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _load_weight(
    layer: ColumnParallelLinear | RowParallelLinear,
    shard: torch.Tensor,
    fp8_rows: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Copy this rank's ``shard`` into ``layer.weight``; once FP8 quantization freed that weight,
    quantize the shard (in the model dtype) into the layer's FP8 buffers in place instead, or into
    ``fp8_rows`` (a fused piece's rows of its owner's buffers)."""
    if not layer.weight.is_meta:
        layer.weight.copy_(shard)
        return
    q, scale = fp8_rows if fp8_rows is not None else (layer.fp8_weight, layer.fp8_weight_scale)
    if q is None or scale is None:
        raise RuntimeError("weight freed without an FP8 copy to load into")
    quantize_into(q, scale, shard.to(layer.weight.dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output features split over ranks: each rank computes its slice of y.

    Weight shape on this rank: [out_features / tp, in_features]. `gather_output` concatenates the
    slices (rarely wanted: the next layer is normally a RowParallelLinear that takes them as is).
    """

    fp8_weight: torch.Tensor | None
    fp8_weight_scale: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TpGroup,
        *,
        bias: bool = False,
        gather_output: bool = False,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        start, end = tp.shard_range(out_features)
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.weight = nn.Parameter(
            torch.empty(end - start, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(end - start, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        # True when this layer is one piece of a fused weight (layers.fuse_column_linears): the
        # owner runs and quantizes the fused matmul, so the piece never quantizes itself.
        self.fused = False
        # FP8 copy of this rank's weight (kvrelay.models.fp8), None unless quantized.
        self.register_buffer("fp8_weight", None, persistent=False)
        self.register_buffer("fp8_weight_scale", None, persistent=False)
        # A fused piece whose owner quantized the fused weight and freed it: this piece's rows of
        # the owner's FP8 buffers (e4m3 [rows, in], scales [1, rows]), where its weight now loads.
        self.fp8_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantize_fp8_(self, keep_source: bool = False) -> int:
        """Quantize this rank's weight shard (per output feature, so a shard's scales are the full
        weight's rows) and free the source unless ``keep_source``; the bias stays in the model
        dtype. A fused piece returns 0: its owner quantizes the fused weight."""
        if self.fused:
            return 0
        quantize_source_(self, "weight", "fp8_weight", keep_source=keep_source)
        return 1

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's rows of the full (unsharded) weight [out, in] (and bias [out]), from
        any device; quantized straight into the FP8 buffers once the source weight is freed."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        with torch.no_grad():
            _load_weight(self, self.tp.shard(weight, 0), self.fp8_rows)
            if self.bias is not None:
                if bias is None:
                    raise ValueError("layer has a bias but none was given")
                self.bias.copy_(self.tp.shard(bias, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.fp8_weight, self.fp8_weight_scale)
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input features split over ranks: each rank multiplies its slice of x
    and the partial sums are all-reduced, so every rank ends with the full y.

    Weight shape on this rank: [out_features, in_features / tp]. The bias is added once, after
    the reduction (adding it on every rank would count it tp times).
    """

    fp8_weight: torch.Tensor | None
    fp8_weight_scale: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TpGroup,
        *,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__()
        start, end = tp.shard_range(in_features)
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, end - start, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        # FP8 copy of this rank's weight (kvrelay.models.fp8), None unless quantized.
        self.register_buffer("fp8_weight", None, persistent=False)
        self.register_buffer("fp8_weight_scale", None, persistent=False)

    def quantize_fp8_(self, keep_source: bool = False) -> int:
        """Quantize this rank's weight shard (per output feature: partial sums stay exact to add)
        and free the source unless ``keep_source``."""
        quantize_source_(self, "weight", "fp8_weight", keep_source=keep_source)
        return 1

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's columns of the full weight [out, in] (the bias is replicated), from
        any device; quantized straight into the FP8 buffers once the source weight is freed."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        with torch.no_grad():
            _load_weight(self, self.tp.shard(weight, 1), None)
            if self.bias is not None:
                if bias is None:
                    raise ValueError("layer has a bias but none was given")
                self.bias.copy_(bias)

    def forward(self, x_parallel: torch.Tensor) -> torch.Tensor:
        y = linear(x_parallel, self.weight, None, self.fp8_weight, self.fp8_weight_scale)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y
