"""Ulysses sequence parallelism: all-to-all between sequence-sharded and head-sharded tensors.

Each of `sp` ranks holds a contiguous 1/sp of the tokens with every head; before attention one
all-to-all gives each rank every token for 1/sp of the heads (so attention is local, including
over the KV prefix, whose head shard each SP rank receives whole), and one all-to-all after it
returns to sequence shards. Owns only these exchanges; never the attention or the model.
Tensors are heads-major: [..., heads, tokens, head_dim].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvrelay.models.parallel import TpGroup


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: TpGroup) -> torch.Tensor:
    """Split `x` into `world` chunks along `scatter_dim`, send chunk j to rank j, and concatenate
    what arrives (in rank order) along `gather_dim`."""
    world = group.world_size
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(
            f"dim {scatter_dim} of size {x.shape[scatter_dim]} does not split over {world} ranks"
        )
    if group.stages_through_host(x):  # gloo has no all-to-all on CUDA tensors
        return all_to_all(x.cpu(), scatter_dim, gather_dim, group).to(x.device)
    inputs = [chunk.contiguous() for chunk in x.chunk(world, dim=scatter_dim)]
    global _alltoall_unsupported
    if not _alltoall_unsupported:
        outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
        try:
            dist.all_to_all(outputs, inputs, group=group.group)
            return torch.cat(outputs, dim=gather_dim)
        except RuntimeError as exc:
            # gloo gained alltoall only after torch 2.11 (the GPU image's build lacks it). The
            # refusal is raised before any communication, on every rank alike, so all ranks
            # take the fallback together.
            if "does not support alltoall" not in str(exc):
                raise
            _alltoall_unsupported = True
    return torch.cat(_all_to_all_by_gather(inputs, group), dim=gather_dim)


_alltoall_unsupported = False


def _all_to_all_by_gather(inputs: list[torch.Tensor], group: TpGroup) -> list[torch.Tensor]:
    """all-to-all from one all-gather: every rank receives all chunks and keeps the ones
    addressed to it. world times the traffic, so only for gloo builds without alltoall."""
    stacked = torch.stack(inputs)  # [dst, ...]
    gathered = group.all_gather(stacked.unsqueeze(0), dim=0)  # [src, dst, ...]
    return list(gathered[:, group.rank].unbind(0))


def seq_to_heads(x: torch.Tensor, group: TpGroup) -> torch.Tensor:
    """[..., H, T/sp, D] (this rank's tokens, all heads) -> [..., H/sp, T, D] (all tokens, this
    rank's heads [rank*H/sp, (rank+1)*H/sp))."""
    return all_to_all(x, scatter_dim=-3, gather_dim=-2, group=group)


def heads_to_seq(x: torch.Tensor, group: TpGroup) -> torch.Tensor:
    """Inverse of seq_to_heads: [..., H/sp, T, D] -> [..., H, T/sp, D]."""
    return all_to_all(x, scatter_dim=-2, gather_dim=-3, group=group)


def shard_sequence(x: torch.Tensor, dim: int, group: TpGroup) -> torch.Tensor:
    """This rank's contiguous share of the tokens along `dim` (the layout seq_to_heads expects)."""
    return group.shard(x, dim)


def gather_sequence(x: torch.Tensor, dim: int, group: TpGroup) -> torch.Tensor:
    """Concatenate every rank's token share along `dim` (inverse of shard_sequence)."""
    return group.all_gather(x, dim)
