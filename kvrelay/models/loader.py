"""Safetensors checkpoints with explicit key maps, sharded on load for tensor parallelism.

Owns: the mapping between a model's parameter names and a checkpoint's tensor names (with the
dimension each tensor is split along under TP), reading only this rank's slice of each tensor
(safetensors slices, so a TP rank never materializes the full matrix), writing checkpoints
(tests and users export random models), the Llama/Qwen2 family's names, and full (unsharded)
tensors by parameter name loaded into a sharded module (the DiT's checkpoints). A checkpoint's
layout, headers and config.json (read without torch, by the services too) are
kvrelay.models.checkpoint's. Never downloads anything: a checkpoint is a local directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

# A checkpoint's files, headers and config.json: kvrelay.models.checkpoint, without torch (the
# services read them before their ranks start; import them from there).
from kvrelay.models import checkpoint as _checkpoint
from kvrelay.models.checkpoint import (
    CheckpointError,
    check_float,
    checkpoint_layout,
    missing_hint,
    scan_tensors,
)
from kvrelay.models.moe import RoutedExperts
from kvrelay.models.parallel import ColumnParallelLinear, RowParallelLinear, TpGroup

COLUMN = 0  # split along output features (q/k/v, gate/up): Megatron column parallel
ROW = 1  # split along input features (o_proj, down_proj): Megatron row parallel


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One parameter: its name in the model (`model_key`), in the files (`file_key`), and the
    dimension it is split along over TP ranks (None: every rank holds all of it)."""

    model_key: str
    file_key: str
    shard_dim: int | None = None
    optional: bool = False  # absent from a checkpoint without error (e.g. biases some families lack)


KeyMap = tuple[TensorSpec, ...]


def open_safetensors(path: Path) -> Any:
    """A checkpoint file opened to read torch tensors (kvrelay.models.checkpoint.open_safetensors:
    its errors a CheckpointError naming the file)."""
    return _checkpoint.open_safetensors(path, framework="pt")


def llama_key_map(num_layers: int, *, qkv_bias: bool = False) -> KeyMap:
    """Hugging Face Llama / Qwen2 names (`model.layers.{i}.self_attn.q_proj.weight`, ...) for the
    built-in AR decoder. The LM head and final norm are not mapped: prefill only needs K/V."""
    specs = [TensorSpec("embed_tokens.weight", "model.embed_tokens.weight")]
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        specs += [
            TensorSpec(ours + "input_layernorm.weight", theirs + "input_layernorm.weight"),
            TensorSpec(ours + "self_attn.q_proj.weight", theirs + "self_attn.q_proj.weight", COLUMN),
            TensorSpec(ours + "self_attn.k_proj.weight", theirs + "self_attn.k_proj.weight", COLUMN),
            TensorSpec(ours + "self_attn.v_proj.weight", theirs + "self_attn.v_proj.weight", COLUMN),
            TensorSpec(ours + "self_attn.o_proj.weight", theirs + "self_attn.o_proj.weight", ROW),
            TensorSpec(ours + "post_attention_layernorm.weight", theirs + "post_attention_layernorm.weight"),
            TensorSpec(ours + "mlp.gate_proj.weight", theirs + "mlp.gate_proj.weight", COLUMN),
            TensorSpec(ours + "mlp.up_proj.weight", theirs + "mlp.up_proj.weight", COLUMN),
            TensorSpec(ours + "mlp.down_proj.weight", theirs + "mlp.down_proj.weight", ROW),
        ]
        if qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                specs.append(
                    TensorSpec(ours + f"self_attn.{proj}.bias", theirs + f"self_attn.{proj}.bias", COLUMN)
                )
    return tuple(specs)


def hf_unused_tensor(key: str) -> bool:
    """Tensors of a Llama/Qwen2 decoder (`model.*`) prefill does not need: the final norm (it
    feeds only the LM head) and the RoPE tables older exports saved (recomputed from rope_theta)."""
    return key == "model.norm.weight" or key.endswith(".rotary_emb.inv_freq")



def read_checkpoint(
    directory: str | Path,
    key_map: KeyMap,
    tp: TpGroup | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    strict_prefix: str | None = None,
    unused: Callable[[str], bool] = lambda key: False,
    expected: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's share of every mapped tensor, keyed by model name.

    Split dimensions must divide evenly over the TP size (CheckpointError otherwise); tensors
    are cast to `dtype` when given. Tensors in the files that the map does not name are ignored
    (LM heads, vision towers of a bigger checkpoint), except under `strict_prefix`: there every
    tensor must be mapped or `unused(key)` (a tensor of the decoder the model does not have, as
    Qwen3's QK-norm or a layer past the config's count, would change its output unseen).
    `expected` (model name -> full, unsharded shape) checks each stored shape before any read,
    naming the file's tensor, the file and both shapes.
    """
    tp = tp or TpGroup.single()
    stored = scan_tensors(*checkpoint_layout(directory))
    if strict_prefix is not None:
        mapped = {spec.file_key for spec in key_map}
        for key in sorted(stored):
            if key.startswith(strict_prefix) and key not in mapped and not unused(key):
                raise CheckpointError(
                    f"checkpoint {directory} has tensor {key!r} ({stored[key].path.name}), which the model "
                    f"does not have: not a checkpoint of the architecture config.json describes"
                )
    out: dict[str, torch.Tensor] = {}
    handles: dict[Path, Any] = {}
    try:
        for spec in key_map:
            found = stored.get(spec.file_key)
            if found is None:
                if spec.optional:
                    continue
                hint = missing_hint(spec.file_key, stored)
                raise CheckpointError(f"checkpoint {directory} has no tensor {spec.file_key!r}{hint}")
            want = (expected or {}).get(spec.model_key)
            if want is not None and tuple(want) != found.shape:
                raise CheckpointError(
                    f"{spec.file_key}: shape {found.shape} in {found.path.name}, the model expects {tuple(want)} "
                    f"(from config.json)"
                )
            check_float(spec.file_key, found)
            path = found.path
            if path not in handles:
                handles[path] = open_safetensors(path).__enter__()
            piece = handles[path].get_slice(spec.file_key)
            shape = piece.get_shape()
            if spec.shard_dim is None or tp.world_size == 1:
                tensor = piece[:]
            else:
                if spec.shard_dim >= len(shape):
                    raise CheckpointError(f"{spec.file_key} in {path.name}: shape {tuple(shape)} has no dim {spec.shard_dim} to split")
                size = shape[spec.shard_dim]
                if size % tp.world_size:
                    raise CheckpointError(
                        f"{spec.file_key}: dim {spec.shard_dim} of size {size} does not split over "
                        f"tensor parallel size {tp.world_size}"
                    )
                start, end = tp.shard_range(size)
                index = tuple(
                    slice(start, end) if d == spec.shard_dim else slice(None) for d in range(len(shape))
                )
                tensor = piece[index]
            out[spec.model_key] = tensor.to(device=device, dtype=dtype or tensor.dtype)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return out


def write_checkpoint(
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor],
    key_map: KeyMap,
    *,
    config: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write full (unsharded) tensors keyed by model name as `model.safetensors` under the map's
    file names, plus `config.json` when given. Returns the file written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    by_model = {spec.model_key: spec for spec in key_map}
    unknown = sorted(set(tensors) - set(by_model))
    if unknown:
        raise CheckpointError(f"tensors not in the key map: {unknown[:5]}")
    missing = [s.model_key for s in key_map if s.model_key not in tensors and not s.optional]
    if missing:
        raise CheckpointError(f"missing tensors for the key map: {missing[:5]}")
    # Copies: fused projections make parameters views of one buffer (safetensors refuses shared memory).
    files = {by_model[k].file_key: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}
    path = directory / "model.safetensors"
    save_file(files, str(path), metadata={"format": "pt", **(metadata or {})})
    if config is not None:
        (directory / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    return path


def load_into_module(
    module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Copy tensors (this rank's shards, keyed by parameter name) into `module`'s parameters,
    checking every shape: a wrong split shows up here, not as garbage activations later."""
    params = dict(module.named_parameters())
    if strict:
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise CheckpointError(f"no weights for parameters {missing[:5]}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name not in params:
                raise CheckpointError(f"tensor {name!r} matches no parameter of {type(module).__name__}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}"
                )
            param.copy_(tensor)


# ---------------------------------------------------------------------------------------------
# Full (unsharded) tensors by parameter name, sharded on load (the DiT's checkpoints)
# ---------------------------------------------------------------------------------------------


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of an unsharded (world size 1) module, by name, on CPU, contiguous.
    Refuses a module whose FP8 quantization freed source weights (it no longer holds them)."""
    freed = [name for name, p in module.named_parameters() if p.is_meta]
    if freed:
        raise ValueError(f"{freed[0]} (and {len(freed) - 1} more) were freed by FP8 quantization: no weights to save")
    # A copy even on CPU: fused projections make parameters views of one buffer, and safetensors
    # refuses tensors that share memory.
    return {name: p.detach().to("cpu", copy=True).contiguous() for name, p in module.named_parameters()}


@torch.no_grad()
def load_full_state(module: nn.Module, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Load full tensors into a possibly sharded module: parallel linears keep their shard (as
    `kvrelay.models.dit.init_seeded_weights` does), every other parameter is copied whole. A
    missing tensor or a wrong shape raises CheckpointError naming it; nothing is guessed."""
    done: set[str] = set()
    for name, mod in module.named_modules():
        if isinstance(mod, RoutedExperts):
            keys = [f"{prefix}{name}.w_gate_up", f"{prefix}{name}.w_down"]
            for key in keys:
                if key not in tensors:
                    raise CheckpointError(f"checkpoint has no tensor {key!r}")
            try:
                mod.load_full(*(tensors[k].to(mod.w_gate_up.device, mod.w_gate_up.dtype) for k in keys))
            except ValueError as err:
                raise CheckpointError(f"{keys[0]}: {err}") from None
            done.update({f"{name}.w_gate_up", f"{name}.w_down"})
        elif isinstance(mod, ColumnParallelLinear | RowParallelLinear):
            key = f"{prefix}{name}.weight"
            if key not in tensors:
                raise CheckpointError(f"checkpoint has no tensor {key!r}")
            bias_key = f"{prefix}{name}.bias"
            bias = tensors.get(bias_key) if mod.bias is not None else None
            if mod.bias is not None and bias is None:
                raise CheckpointError(f"checkpoint has no tensor {bias_key!r}")
            # Sharded where the tensor is, then copied: only this rank's shard reaches the device
            # (a quantized layer's freed weight is a meta tensor: load_full quantizes into FP8).
            try:
                mod.load_full(tensors[key].to(dtype=mod.weight.dtype),
                              None if bias is None else bias.to(dtype=mod.weight.dtype))
            except ValueError as err:
                raise CheckpointError(f"{key}: {err}") from None
            done.update({f"{name}.weight", f"{name}.bias"})
    for name, param in module.named_parameters():
        if name in done:
            continue
        key = f"{prefix}{name}"
        if key not in tensors:
            raise CheckpointError(f"checkpoint has no tensor {key!r}")
        if tuple(tensors[key].shape) != tuple(param.shape):
            raise CheckpointError(f"{key}: shape {tuple(tensors[key].shape)} != model's {tuple(param.shape)}")
        param.copy_(tensors[key].to(param.device, param.dtype))


