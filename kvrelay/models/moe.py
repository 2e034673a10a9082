"""Mixture-of-experts MLP (HunyuanImage-3 style) with tensor or expert parallelism.

Owns the MoE MLP of a DiT block: a softmax router picks ``top_k`` of ``num_experts`` routed
SwiGLU experts per token (the top-k weights renormalized to sum to 1) and one shared SwiGLU
expert sees every token; the block's MLP output is ``shared(x) + sum_k w_k * expert_k(x)``.

Two layouts over the TP group (whose ranks hold the same, replicated tokens):

- Expert parallel off: every rank holds every expert, each expert's intermediate features split
  over the TP ranks (Megatron column/row); the routed and shared partial sums end in ONE
  all-reduce.
- Expert parallel on (``expert_parallel=True``): rank r holds experts
  ``[r*E/tp, (r+1)*E/tp)`` whole. Each rank routes its contiguous 1/tp share of the tokens,
  dispatches every (token, expert) pair to the expert's owner with an all-to-all, the owners run
  their experts, a second all-to-all brings the results back (combine), and the rank writes its
  tokens' weighted sums into a zero tensor of all tokens; adding the shared expert's TP partial
  and ONE all-reduce makes every rank's output whole again.
  gloo builds without alltoall (torch 2.11, the GPU image) fall back to one all-gather of the
  padded per-destination chunks and a local select (world x the traffic; correct, slower).

Never owns processes or checkpoints' files: weights arrive through ``fill``/``load_full``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvrelay.models.layers import SwiGLU, init_std
from kvrelay.models.parallel import TpGroup

# fill(name, shape, std) -> a full fp32 tensor drawn from (seed, name): see kvrelay/models/dit.py.
TensorSource = Callable[[str, tuple[int, ...], float], torch.Tensor]


class RoutedExperts(nn.Module):
    """The routed experts' weights, stacked: ``w_gate_up [E_local, 2 * I_local, H]`` (each
    expert's gate rows then its up rows) and ``w_down [E_local, H, I_local]``.

    Full (checkpoint) shapes are ``[E, 2I, H]`` and ``[E, H, I]``; this rank keeps experts
    ``experts`` (all of them, or its EP share) and, without EP, its TP slice of I."""

    def __init__(
        self,
        hidden: int,
        expert_mlp: int,
        num_experts: int,
        tp: TpGroup,
        *,
        expert_parallel: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.hidden, self.expert_mlp, self.num_experts = hidden, expert_mlp, num_experts
        self.tp = tp
        self.expert_parallel = expert_parallel and tp.world_size > 1
        if self.expert_parallel:
            if num_experts % tp.world_size:
                raise ValueError(f"num_experts={num_experts} does not split over {tp.world_size} EP ranks")
            lo, hi = tp.shard_range(num_experts)
            self.experts = range(lo, hi)
            self.mlp_range = (0, expert_mlp)
        else:
            self.experts = range(num_experts)
            self.mlp_range = tp.shard_range(expert_mlp)
        i_local = self.mlp_range[1] - self.mlp_range[0]
        e_local = len(self.experts)
        self.w_gate_up = nn.Parameter(
            torch.empty(e_local, 2 * i_local, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.w_down = nn.Parameter(
            torch.empty(e_local, hidden, i_local, dtype=dtype, device=device), requires_grad=False
        )

    @torch.no_grad()
    def load_expert(self, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy this rank's slice of one expert's full weights ``[2I, H]`` and ``[H, I]``."""
        i, h = self.expert_mlp, self.hidden
        if tuple(gate_up.shape) != (2 * i, h) or tuple(down.shape) != (h, i):
            raise ValueError(
                f"expert {expert}: shapes {tuple(gate_up.shape)}/{tuple(down.shape)} != {(2 * i, h)}/{(h, i)}"
            )
        local = expert - self.experts.start
        lo, hi = self.mlp_range
        self.w_gate_up[local].copy_(torch.cat((gate_up[lo:hi], gate_up[i + lo : i + hi])))
        self.w_down[local].copy_(down[:, lo:hi])

    def load_full(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """From the full stacked tensors ``[E, 2I, H]`` and ``[E, H, I]`` (a checkpoint's)."""
        if gate_up.shape[0] != self.num_experts or down.shape[0] != self.num_experts:
            raise ValueError(f"{gate_up.shape[0]}/{down.shape[0]} experts, the model has {self.num_experts}")
        for e in self.experts:
            self.load_expert(e, gate_up[e], down[e])

    def fill(self, source: TensorSource) -> None:
        """Seeded weights, one tensor per expert (``{e}.gate_up``, ``{e}.down``), so an EP rank
        draws only its own experts and every layout sees the same model."""
        i, h = self.expert_mlp, self.hidden
        for e in self.experts:
            gate_up = source(f"{e}.gate_up", (2 * i, h), init_std(h))
            down = source(f"{e}.down", (h, i), init_std(i))
            self.load_expert(e, gate_up.to(self.w_gate_up.dtype), down.to(self.w_down.dtype))

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x [N, H]`` grouped by local expert (``counts[j]`` rows for local expert j, in order)
        -> each row through its expert ``[N, H]`` (a TP partial sum without EP)."""
        out = torch.empty_like(x)
        start = 0
        for j, n in enumerate(counts):
            if n:
                gate, up = F.linear(x[start : start + n], self.w_gate_up[j]).chunk(2, dim=-1)
                out[start : start + n] = F.linear(F.silu(gate) * up, self.w_down[j])
                start += n
        return out


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [N, k], expert ids [N, k]): softmax in fp32, top k, renormalized."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


class MoeMlp(nn.Module):
    """``shared(x) + sum_k w_k * expert_k(x)`` over ``x [..., H]`` (replicated on the TP ranks)."""

    def __init__(
        self,
        hidden: int,
        shared_mlp: int,
        expert_mlp: int,
        num_experts: int,
        top_k: int,
        tp: TpGroup,
        *,
        expert_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.tp, self.top_k, self.num_experts = tp, top_k, num_experts
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        self.shared = SwiGLU(hidden, shared_mlp, tp, dtype=dtype, device=device)
        self.experts = RoutedExperts(
            hidden, expert_mlp, num_experts, tp, expert_parallel=expert_parallel, dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, hidden = x.shape, x.shape[-1]
        flat = x.reshape(-1, hidden)
        # The shared expert's partial sum (its down projection not yet reduced over TP).
        gate, up = F.linear(flat, self.shared._gate_up).chunk(2, dim=-1)
        partial = F.linear(F.silu(gate) * up, self.shared.down_proj.weight).float()
        if self.experts.expert_parallel:
            self._routed_expert_parallel(flat, partial)
        else:
            self._routed_local(flat, partial)
        out = self.tp.all_reduce(partial.to(x.dtype))
        return out.reshape(shape)

    def _routed_local(self, flat: torch.Tensor, acc: torch.Tensor) -> None:
        """Every expert on this rank (its TP slice): add the weighted routed partials into ``acc``."""
        weights, ids = route(self.router(flat), self.top_k)
        token = torch.arange(flat.shape[0], device=flat.device).repeat_interleave(self.top_k)
        expert = ids.flatten()
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        y = self.experts.compute(flat[token[order]], counts)
        acc.index_add_(0, token[order], y.float() * weights.flatten()[order, None])

    def _routed_expert_parallel(self, flat: torch.Tensor, acc: torch.Tensor) -> None:
        """Route my 1/tp of the tokens, dispatch to the experts' owners, compute, combine."""
        tp, world = self.tp, self.tp.world_size
        n = flat.shape[0]
        per = -(-n // world)
        lo, hi = min(n, tp.rank * per), min(n, (tp.rank + 1) * per)
        own = flat[lo:hi]
        weights, ids = route(self.router(own), self.top_k)
        token = torch.arange(hi - lo, device=flat.device).repeat_interleave(self.top_k)
        expert = ids.flatten()
        # Sorted by global expert id = grouped by owner rank, each owner's rows by its experts.
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.num_experts)
        # counts[src, e]: rows rank src sends for expert e (every rank learns every count).
        matrix = tp.all_gather(counts.unsqueeze(0), dim=0).tolist()
        e_local = self.num_experts // world
        send_rows = [sum(matrix[tp.rank][d * e_local : (d + 1) * e_local]) for d in range(world)]
        recv_rows = [sum(matrix[s][tp.rank * e_local : (tp.rank + 1) * e_local]) for s in range(world)]
        most = max(sum(matrix[s][d * e_local : (d + 1) * e_local]) for s in range(world) for d in range(world))
        dispatched = exchange(list(torch.split(own[token[order]], send_rows)), recv_rows, most, tp)
        # What arrived, regrouped by my local expert (per source, rows are already by expert).
        mine = range(tp.rank * e_local, (tp.rank + 1) * e_local)
        pieces: list[list[torch.Tensor]] = [[] for _ in mine]
        for s, chunk in enumerate(dispatched):
            for j, part in enumerate(torch.split(chunk, [matrix[s][e] for e in mine])):
                pieces[j].append(part)
        grouped = torch.cat([p for per_expert in pieces for p in per_expert])
        y = self.experts.compute(grouped, [sum(matrix[s][e] for s in range(world)) for e in mine])
        # Back to source order: un-group by expert into per-source chunks.
        back_by_expert = torch.split(y, [sum(matrix[s][e] for s in range(world)) for e in mine])
        per_source: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for j, e in enumerate(mine):
            for s, part in enumerate(torch.split(back_by_expert[j], [matrix[s][e] for s in range(world)])):
                per_source[s].append(part)
        replies = [torch.cat(parts) for parts in per_source]
        combined = torch.cat(exchange(replies, send_rows, most, tp))
        acc[lo:hi].index_add_(0, token[order], combined.float() * weights.flatten()[order, None])


_alltoall_unsupported = False


def exchange(chunks: list[torch.Tensor], recv_rows: list[int], most: int, group: TpGroup) -> list[torch.Tensor]:
    """Variable-size all-to-all of row chunks ``[n_d, H]``: chunk d goes to rank d; returns the
    chunk from each source (``recv_rows[s]`` rows). ``most`` is the largest chunk anywhere (the
    all-gather fallback pads to it)."""
    global _alltoall_unsupported
    if group.world_size == 1:
        return chunks
    if group.stages_through_host(chunks[0]):  # gloo has no all-to-all on CUDA tensors
        host = exchange([c.cpu() for c in chunks], recv_rows, most, group)
        return [c.to(chunks[0].device) for c in host]
    width, like = chunks[0].shape[1:], chunks[0]
    if not _alltoall_unsupported:
        output = like.new_empty((sum(recv_rows), *width))
        try:
            # The single-tensor form takes per-rank row counts (alltoallv); gloo's list form
            # insists on equal sizes.
            dist.all_to_all_single(
                output, torch.cat(chunks), output_split_sizes=list(recv_rows),
                input_split_sizes=[c.shape[0] for c in chunks], group=group.group,
            )
            return list(torch.split(output, list(recv_rows)))
        except RuntimeError as exc:
            # gloo gained alltoall only after torch 2.11; the refusal comes before any traffic,
            # on every rank alike, so all ranks take the fallback together.
            if "does not support alltoall" not in str(exc):
                raise
            _alltoall_unsupported = True
    padded = like.new_zeros((group.world_size, max(most, 1), *width))
    for d, c in enumerate(chunks):
        padded[d, : c.shape[0]] = c
    gathered = group.all_gather(padded.unsqueeze(0), dim=0)  # [src, dst, most, ...]
    return [gathered[s, group.rank, :n] for s, n in enumerate(recv_rows)]


def build_mlp(
    hidden: int,
    mlp: int,
    tp: TpGroup,
    *,
    num_experts: int = 0,
    top_k: int = 0,
    expert_mlp: int = 0,
    expert_parallel: bool = False,
    dtype: torch.dtype,
    device: torch.device | str,
) -> nn.Module:
    """The dense SwiGLU (``num_experts == 0``; ``expert_parallel`` has nothing to shard then) or
    the MoE MLP with ``mlp`` as its shared expert's size."""
    if not num_experts:
        return SwiGLU(hidden, mlp, tp, dtype=dtype, device=device)
    return MoeMlp(
        hidden, mlp, expert_mlp, num_experts, top_k, tp,
        expert_parallel=expert_parallel, dtype=dtype, device=device,
    )
