"""The built-in AR model: a Llama-style decoder whose prefill yields the KV prefix.

Owns the decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU; blocks from kvrelay.models),
tensor parallel over kv heads, with weights either random from a seed or read from a local
Llama/Qwen2-family safetensors directory. `prefill` returns every layer's K (after RoPE) and V
for this rank's kv heads, heads-major, ready for packing into DiT pages. It does not tokenize,
transfer or serve: tokenizer.py (beside it), the AR service's sender and service do.

Random weights are generated whole, tensor by tensor, from (seed, parameter name) and then
sliced, so every TP size and every process sees the same model (bit-identical weights on the
same device type; CPU and CUDA generators differ).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from kvrelay.models.checkpoint import ar_config_to_hf, check_hf_checkpoint, read_hf_config
from kvrelay.models.layers import (
    ParallelAttention,
    RMSNorm,
    SwiGLU,
    compile_enabled,
    compiled,
    init_std,
    rope_cos_sin,
    torch_dtype,
)
from kvrelay.models.loader import (
    KeyMap,
    hf_unused_tensor,
    llama_key_map,
    load_into_module,
    read_checkpoint,
    write_checkpoint,
)
from kvrelay.models.parallel import TpGroup
from kvrelay.models.presets import ArConfig, get_preset


class PromptTooLong(ValueError):
    """The prompt has more tokens than the model's max_tokens (maps to INVALID_ARGUMENT)."""


class ArDecoderLayer(nn.Module):
    def __init__(self, cfg: ArConfig, tp: TpGroup, *, dtype: torch.dtype, device: str | torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
        self.self_attn = ParallelAttention(
            cfg.hidden,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            tp,
            qkv_bias=cfg.qkv_bias,
            dtype=dtype,
            device=device,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps, dtype=dtype, device=device)
        self.mlp = SwiGLU(cfg.hidden, cfg.mlp, tp, dtype=dtype, device=device)


def _param_seed(seed: int, name: str) -> int:
    # Per-parameter seeds make each tensor independent of creation order and of which other
    # tensors exist (a Qwen2 bias does not shift the Llama weights).
    digest = hashlib.sha256(f"kvrelay-ar:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ArModel(nn.Module):
    """Llama-style decoder. Parameter names follow `llama_key_map` (Hugging Face names without
    the `model.` prefix); the LM head and final norm are absent because prefill only needs K/V."""

    def __init__(
        self,
        config: ArConfig,
        tp: TpGroup | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        self.config = config
        self.tp = tp or TpGroup.single()
        if config.num_kv_heads % self.tp.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.tp.world_size} does not divide num_kv_heads={config.num_kv_heads}"
            )
        self.dtype = dtype
        self.device = torch.device(device)
        # Replicated: a byte vocabulary is tiny, and a vocab-parallel embedding would add an
        # all-reduce per prefill for little memory saved at 7B scale.
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            [ArDecoderLayer(config, self.tp, dtype=dtype, device=device) for _ in range(config.num_layers)]
        )
        self.num_kv_heads_local = config.num_kv_heads // self.tp.world_size
        self.cuda_graphs = True  # on a GPU at TP=1: prefill replays a graph per shape bucket
        # On GPUs every layer runs through one torch.compile'd function (fused norms and SwiGLU).
        self.compiled_layer: Any = (
            compiled(_run_layer)
            if self.device.type == "cuda" and self.tp.world_size == 1 and compile_enabled()
            else None
        )
        self._graphs: dict[tuple[int, int], PrefillGraph] = {}
        self._graph_pool: Any = None

    @property
    def key_map(self) -> KeyMap:
        return llama_key_map(self.config.num_layers, qkv_bias=self.config.qkv_bias)

    # -- weights ---------------------------------------------------------------------------------

    def init_random(self, seed: int) -> ArModel:
        """Fill every parameter from `seed`: each full tensor is drawn, then this rank's slice kept."""
        specs = {s.model_key: s for s in self.key_map}
        with torch.no_grad():
            for name, param in self.named_parameters():
                full_shape = list(param.shape)
                shard_dim = specs[name].shard_dim
                if shard_dim is not None:
                    full_shape[shard_dim] *= self.tp.world_size
                gen = torch.Generator(device=self.device).manual_seed(_param_seed(seed, name))
                full = torch.randn(full_shape, generator=gen, device=self.device, dtype=torch.float32)
                if name.endswith("norm.weight"):
                    full = 1.0 + 0.1 * full  # near 1 like trained norms, but not all equal
                elif name == "embed_tokens.weight":
                    pass  # unit variance per channel, as RMSNorm expects on the way in
                elif name.endswith(".bias"):
                    full = 0.02 * full
                else:
                    full = full * init_std(full_shape[1])
                if shard_dim is not None:
                    full = self.tp.shard(full, shard_dim)
                param.copy_(full.to(self.dtype))
        return self

    def load_checkpoint(self, directory: str | Path) -> ArModel:
        """Load this rank's shards from a Llama/Qwen2-style safetensors directory."""
        expected = {}
        for spec in self.key_map:
            full = list(self.get_parameter(spec.model_key).shape)
            if spec.shard_dim is not None:
                full[spec.shard_dim] *= self.tp.world_size
            expected[spec.model_key] = tuple(full)
        tensors = read_checkpoint(
            directory, self.key_map, self.tp, dtype=self.dtype, device=self.device,
            strict_prefix="model.", unused=hf_unused_tensor, expected=expected,
        )
        load_into_module(self, tensors)
        return self

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Write the model as a Llama-family checkpoint (model.safetensors + config.json).
        Only a TP=1 model holds whole tensors."""
        if self.tp.world_size != 1:
            raise ValueError("save_checkpoint needs the unsharded (tensor_parallel_size=1) model")
        tensors = {name: p.detach() for name, p in self.named_parameters()}
        return write_checkpoint(directory, tensors, self.key_map, config=ar_config_to_hf(self.config))

    # -- prefill ---------------------------------------------------------------------------------

    def check_prompt(self, token_ids: torch.Tensor) -> None:
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        n = token_ids.numel()
        if n == 0:
            raise ValueError("prompt has no tokens")
        if n > self.config.max_tokens:
            raise PromptTooLong(f"prompt has {n} tokens; the model's max is {self.config.max_tokens}")
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= self.config.vocab:
            raise ValueError(f"token ids must be in [0, {self.config.vocab}), got [{lo}, {hi}]")

    # no_grad rather than inference_mode: the returned K/V are ordinary tensors that the sender
    # may slice, pad and copy in place without tripping inference-tensor rules.
    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        """K/V of every prompt token: [num_layers, 2, num_kv_heads_local, T, head_dim], K after
        RoPE at positions 0..T-1, in the model dtype, on the model device. Every TP rank must
        call it with the same tokens (the row parallel layers all-reduce)."""
        return self.prefill_batch([token_ids])[0]

    @torch.no_grad()
    def prefill_batch(self, prompts: list[torch.Tensor | list[int]]) -> list[torch.Tensor]:
        """``prefill`` of several prompts. On a GPU with graphs on (TP=1) the rows are packed: up
        to ``PACK_TOKENS`` tokens of consecutive rows run as one sequence (positions restart at 0
        per row, attention causal within a row only, padded at the end to a token bucket), so a
        96 + 16 token pair costs a 128-token forward, not two 128-token rows. Each pack replays a
        CUDA graph captured once per (bucket, packed or single row); a longer row runs alone.
        Each row's K/V are cut back to its length. Without graphs each row runs alone (bit-equal
        to ``prefill``)."""
        ids_list = [torch.as_tensor(p, dtype=torch.long) for p in prompts]
        if not ids_list:
            return []
        for ids in ids_list:
            self.check_prompt(ids)
        lengths = [int(ids.numel()) for ids in ids_list]
        if not self.use_graphs:
            # Without graphs each row runs alone at its own length: the same K/V bits as a
            # one-prompt prefill (padding would change the matmul shapes, hence the rounding).
            out = []
            for ids, n in zip(ids_list, lengths, strict=True):
                kv = torch.empty(self.kv_shape(1, n), dtype=self.dtype, device=self.device)
                self.forward_kv(ids.to(self.device)[None], kv)
                out.append(kv[:, :, 0])
            return out
        out_by_row: dict[int, torch.Tensor] = {}
        for pack in pack_rows(lengths, PACK_TOKENS):
            ids, positions, segments = packed_inputs([ids_list[r] for r in pack], self.bucket(sum(lengths[r] for r in pack)))
            kv = self._graph(ids.shape[1], packed=len(pack) > 1).run(ids, positions, segments)
            start = 0
            for r in pack:
                # [layers, 2, 1, heads, T, D] -> this row's [layers, 2, heads, T_r, D], own memory.
                out_by_row[r] = kv[:, :, 0, :, start : start + lengths[r]].contiguous()
                start += lengths[r]
        return [out_by_row[r] for r in range(len(ids_list))]

    def kv_shape(self, rows: int, tokens: int) -> tuple[int, ...]:
        cfg = self.config
        return (cfg.num_layers, 2, rows, self.num_kv_heads_local, tokens, cfg.head_dim)

    def bucket(self, tokens: int) -> int:
        """Tokens of a padded pack: exact on CPU; on GPUs the next of 64, 96, 128, 192, 256, 384, ...
        (powers of two and their halfway points: at most a third is padding), so a few captured
        graphs serve every request."""
        if not self.use_graphs:
            return tokens
        return token_bucket(tokens, max(self.config.max_tokens, PACK_TOKENS))

    @torch.no_grad()
    def forward_kv(
        self,
        ids: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> None:
        """Write the K/V of token ids ``[rows, T]`` (on the model device) into ``kv`` (``kv_shape``).
        A packed sequence (rows == 1) gives each token's RoPE ``positions`` ``[T]`` and its row's
        ``segments`` id ``[T]``: a token attends to earlier tokens of its own segment only.
        No host synchronisation: a CUDA graph can capture it."""
        cfg = self.config
        t = ids.shape[1]
        index = torch.arange(t, device=self.device)
        cos, sin = rope_cos_sin(index if positions is None else positions, cfg.head_dim, cfg.rope_theta, dtype=self.dtype)
        mask = None
        if segments is not None:
            mask = (segments[:, None] == segments[None, :]) & (index[:, None] >= index[None, :])
        x = self.embed_tokens(ids)
        run_layer = self.compiled_layer or _run_layer
        last = len(self.layers) - 1
        for i, module in enumerate(self.layers):
            # Nothing after the last layer's attention changes any K/V: its MLP is skipped.
            x = run_layer(module, x, cos, sin, kv[i, 0], kv[i, 1], i == last, mask)

    def warm_up(self) -> None:
        """On a GPU: compile the layer and capture the prefill graphs of the common buckets now
        (two shapes, so the compiled code is already shape-generic), not on the first request."""
        if self.device.type != "cuda":
            return
        for tokens in (64, 128):
            n = min(tokens, self.config.max_tokens)
            self.prefill_batch([[1] * n, [1] * 16])  # packed rows
            self.prefill_batch([[1] * n])  # one row: causal attention without a mask

    @property
    def use_graphs(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda" and self.tp.world_size == 1

    def _graph(self, tokens: int, *, packed: bool) -> PrefillGraph:
        key = (tokens, packed)
        graph = self._graphs.get(key)
        if graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = PrefillGraph(self, tokens, packed, self._graph_pool)
            self._graphs[key] = graph
        return graph


PACK_TOKENS = 1024
"""Rows whose lengths add up to at most this many tokens are prefilled as one packed sequence.
Its attention masks other rows' tokens densely (O(pack²) work), cheap next to the matmuls at this
size; a longer row runs alone with causal attention."""


def token_bucket(tokens: int, upper: int) -> int:
    """The smallest of 64, 96, 128, 192, 256, 384, ... (a power of two or 1.5 times one) that holds
    ``tokens``, at most ``upper``."""
    bucket = 64
    while bucket < tokens:
        bucket = bucket * 3 // 2 if bucket & (bucket - 1) == 0 else bucket * 4 // 3
    return min(bucket, upper)


def pack_rows(lengths: list[int], limit: int) -> list[list[int]]:
    """Consecutive rows grouped greedily into packs of at most ``limit`` tokens (a row longer
    than ``limit`` is a pack of its own); the row indices of each pack, in order."""
    packs: list[list[int]] = []
    current: list[int] = []
    total = 0
    for row, n in enumerate(lengths):
        if current and total + n > limit:
            packs.append(current)
            current, total = [], 0
        current.append(row)
        total += n
    if current:
        packs.append(current)
    return packs


def packed_inputs(rows: list[torch.Tensor], tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids ``[1, tokens]``, RoPE positions and segment ids ``[tokens]`` of ``rows`` laid end
    to end: positions restart at 0 per row; the padding after the last row is a segment of its own
    (id ``len(rows)``), so no row attends to it and every padding token sees at least itself."""
    total = sum(int(row.numel()) for row in rows)
    if total > tokens:
        raise ValueError(f"{total} tokens do not fit a pack of {tokens}")
    ids = torch.zeros(1, tokens, dtype=torch.long)
    positions = torch.arange(tokens, dtype=torch.long)
    segments = torch.full((tokens,), len(rows), dtype=torch.long)
    start = 0
    for i, row in enumerate(rows):
        n = int(row.numel())
        ids[0, start : start + n] = row
        positions[start : start + n] = torch.arange(n)
        segments[start : start + n] = i
        start += n
    return ids, positions, segments


def _run_layer(
    module: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    last: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoder layer of the prefill: writes its K/V into ``k_out``/``v_out`` and returns the
    hidden state for the next layer (``x`` unchanged after the last one). ``mask`` ``[T, T]``
    (True = attend) replaces plain causal attention for a packed sequence."""
    layer = cast(ArDecoderLayer, module)
    attn_out, k, v = layer.self_attn(layer.input_layernorm(x), cos, sin, causal=True, attn_mask=mask)
    k_out.copy_(k)
    v_out.copy_(v)
    if last:
        return x
    x = x + attn_out
    out: torch.Tensor = x + layer.mlp(layer.post_attention_layernorm(x))
    return out


class PrefillGraph:
    """``ArModel.forward_kv`` of one sequence of ``tokens`` (a packed one when ``packed``) captured
    as a CUDA graph: static ids, positions and segments in, static K/V out (``run`` copies the
    inputs in and replays). The same kernels as the eager forward over the same inputs, so the
    K/V are bit-identical (tests/dit_model/test_cuda_graphs.py)."""

    def __init__(self, model: ArModel, tokens: int, packed: bool, pool: Any) -> None:
        device = model.device
        self.ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self.positions = torch.arange(tokens, dtype=torch.long, device=device)
        self.segments = torch.zeros(tokens, dtype=torch.long, device=device) if packed else None
        self.kv = torch.zeros(model.kv_shape(1, tokens), dtype=model.dtype, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (kernel choice, workspaces)
                self._forward(model)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self._forward(model)

    def _forward(self, model: ArModel) -> None:
        if self.segments is None:
            model.forward_kv(self.ids, self.kv)
        else:
            model.forward_kv(self.ids, self.kv, self.positions, self.segments)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """Replay for ``packed_inputs``; a single-row graph ignores positions and segments (its
        row starts at 0 and the padding after it is causally invisible)."""
        self.ids.copy_(ids, non_blocking=True)
        if self.segments is not None:
            self.positions.copy_(positions, non_blocking=True)
            self.segments.copy_(segments, non_blocking=True)
        self.graph.replay()
        return self.kv


def build_ar_model(
    *,
    preset: str | None = None,
    path: str | Path | None = None,
    seed: int = 0,
    tp: TpGroup | None = None,
    device: str = "cpu",
    dtype: str | None = None,
) -> ArModel:
    """The AR model of a stage config's `model:` entry: `{preset: NAME}` (random weights from
    `seed`) or `{path: DIR}` (a local Llama-family safetensors directory with config.json).

    `dtype` defaults to the preset's, or for a checkpoint to bfloat16 on CUDA and float32 on CPU.
    """
    if (preset is None) == (path is None):
        raise ValueError("give exactly one of preset or path")
    if preset is not None:
        p = get_preset(preset)
        model = ArModel(p.ar, tp, dtype=torch_dtype(dtype or p.dtype), device=device)
        return model.eval().init_random(seed)
    assert path is not None
    cfg = read_hf_config(path)
    check_hf_checkpoint(path, cfg)  # headers against config.json, before allocating its size
    default = "bfloat16" if device.startswith("cuda") else "float32"
    model = ArModel(cfg, tp, dtype=torch_dtype(dtype or default), device=device)
    return model.eval().load_checkpoint(path)
