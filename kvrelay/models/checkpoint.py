"""A checkpoint directory's facts without torch: its safetensors files (index, shards, headers),
a Llama/Qwen2 `config.json`, and the checks of both against each other.

The AR and DiT services read these before they spawn their ranks (a BAGEL directory's geometry,
its special tokens, the latent shapes its weights imply), and a service process never imports
torch: only its ranks do (seconds and hundreds of MB per process). So every tensor here is a
safetensors header entry (`StoredTensor`: shape, dtype, file), read through safetensors' own
parser with the numpy framework (the torch one imports torch), with the same errors. Loading the
tensors themselves is kvrelay.models.loader's, in the ranks; it re-exports all of this.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from kvrelay.limits import read_json_file
from kvrelay.models.formats import hf_family_problem
from kvrelay.models.presets import ArConfig


class CheckpointError(ValueError):
    """A checkpoint directory does not fit the model: missing tensor, wrong shape, no files."""


def llama_shapes(cfg: ArConfig) -> dict[str, tuple[int, ...]]:
    """The full (unsharded) shape of every tensor `llama_key_map` names, by file name, from the
    config alone: checked against the files' headers before the model is built."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (cfg.mlp, h), p + "mlp.up_proj.weight": (cfg.mlp, h),
            p + "mlp.down_proj.weight": (h, cfg.mlp),
        }  # fmt: skip
        if cfg.qkv_bias:
            out |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return out


def require_dir(directory: str | Path) -> Path:
    """`directory` as a Path, or a CheckpointError saying it is not there (before any message
    about a file it lacks, which would send the user looking for the wrong thing)."""
    path = Path(directory)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(
            f"model path {str(directory)!r} {what} (model.path is read on the host of the process)"
        )
    return path


def require_shards(index: Path, files: Sequence[Path]) -> None:
    """Every shard a `*.index.json` names is there; else one error naming the absent ones."""
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise CheckpointError(
            f"{index} names {len(absent)} of {len(files)} shard(s) that are not in {index.parent}: {absent[:5]}"
        )


@dataclass(frozen=True, slots=True)
class WeightIndex:
    """A `model.safetensors.index.json`: where it is and which file holds each tensor."""

    path: Path
    weight_map: dict[str, str]


def read_index(index: Path) -> tuple[list[Path], WeightIndex]:
    """The shard files a `model.safetensors.index.json` names (each must be a plain file name
    beside it, and there), and the index itself for `scan_tensors` to check against."""
    try:
        data = read_json_file(index)
    except ValueError as err:  # FileRefused, not JSON: both name the file already
        raise CheckpointError(str(err)) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise CheckpointError(
            f'{index}: no "weight_map" of tensor name -> shard file name: not a safetensors index'
        )
    names = sorted(set(weight_map.values()))
    for name in names:
        # A shard is a file beside the index: an absolute path or a '..' would read weights from
        # wherever the index points (a symlinked shard, as in Hugging Face's cache, is fine).
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise CheckpointError(f"{index}: shard {name!r} is not a file name in {index.parent}")
    files = [index.parent / n for n in names]
    require_shards(index, files)
    return files, WeightIndex(index, dict(weight_map))


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def no_weights_error(directory: Path, expected: str) -> CheckpointError:
    """The error for a directory without safetensors weights; it names pickle files when that is
    all there is: they are never loaded (unpickling an untrusted file can run any code)."""
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        return CheckpointError(
            f"{directory} has no {expected}, only PyTorch pickle weights {pickles[:5]}: kvrelay loads "
            f"safetensors only and never unpickles a checkpoint (loading a pickle can run any code it "
            f"holds); convert it to safetensors on a machine you trust (transformers: "
            f"save_pretrained(DIR, safe_serialization=True)) or get the release's *.safetensors files"
        )
    return CheckpointError(f"no {expected} in {directory}")


def checkpoint_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (the index's files when there is one)."""
    return checkpoint_layout(directory)[0]


def checkpoint_layout(directory: str | Path) -> tuple[list[Path], WeightIndex | None]:
    """The safetensors files of a checkpoint directory and its index, when there is one (then
    its files only; else every `*.safetensors` of the directory)."""
    directory = require_dir(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return read_index(index)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise no_weights_error(directory, "*.safetensors files")
    return files, None


def unreadable(path: Path, err: BaseException) -> CheckpointError:
    if isinstance(err, OSError):
        link = (
            f" (a link to {os.readlink(path)!r}, which is not there)"
            if path.is_symlink() and not path.exists()
            else ""
        )
        return CheckpointError(f"{path}: cannot be read: {err.strerror or err}{link}")
    return CheckpointError(
        f"{path}: not a readable safetensors file ({err}): a download cut short or a corrupt copy? "
        f"fetch or convert it again"
    )


def open_safetensors(path: Path, *, framework: str = "numpy") -> Any:
    """`safe_open(path)`, its errors (truncated file, bad or huge header, a dangling link, no
    permission) a CheckpointError naming the file. The header is parsed (and checked) alike in
    either framework; "numpy" imports no torch (headers only, the services), the loader's
    tensor reads use "pt"."""
    try:
        return safe_open(str(path), framework=framework)
    except (SafetensorError, OSError) as err:
        raise unreadable(path, err) from None


# The dtypes kvrelay casts from: floating-point weights. Integer, bool or FP8 tensors are a
# quantized checkpoint's (with scales beside them): cast as plain numbers they are garbage.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor of a checkpoint's files, from the safetensors header (no data read)."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, F8_E4M3, I64, ...
    path: Path


def scan_tensors(files: Iterable[Path], index: WeightIndex | None = None) -> dict[str, StoredTensor]:
    """Every tensor of `files` (headers only). A tensor in two files, or one the index places in
    another file than the one holding it (or in none), is a CheckpointError: which copy is
    meant cannot be guessed."""
    out: dict[str, StoredTensor] = {}
    for path in files:
        with open_safetensors(path) as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if key in out:
                    raise CheckpointError(
                        f"tensor {key!r} is in both {out[key].path.name} and {path.name} ({path.parent}): "
                        f"which copy is meant cannot be known; remove the stray file or give a "
                        f"model.safetensors.index.json"
                    )
                piece = f.get_slice(key)
                out[key] = StoredTensor(tuple(piece.get_shape()), str(piece.get_dtype()), path)
    if index is not None:
        for key, name in sorted(index.weight_map.items()):
            found = out.get(key)
            if found is None or found.path.name != name:
                where = "no shard" if found is None else found.path.name
                raise CheckpointError(f"{index.path} puts tensor {key!r} in {name}, but it is in {where}")
    return out


def check_float(key: str, stored: StoredTensor) -> None:
    """CheckpointError unless the stored tensor is floating point (see FLOAT_DTYPES)."""
    if stored.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{key} in {stored.path.name}: stored as {stored.dtype}; kvrelay reads floating-point weights "
            f"({', '.join(FLOAT_DTYPES)}), not quantized checkpoints: give the unquantized (bf16/fp16/fp32) weights"
        )


def check_layer_count(stored: Mapping[str, StoredTensor], prefix: str, num_layers: int, config: Path) -> None:
    """The files hold layers 0..num_layers-1 under `prefix` (`model.layers.`), as the config says:
    checked from the headers before a model of the config's size is built (a config of 10^9
    layers, or one that belongs to other weights, is named instead of allocated)."""
    found = set()
    for key in stored:
        if key.startswith(prefix):
            head = key[len(prefix) :].split(".", 1)[0]
            if head.isdigit():
                found.add(int(head))
    if not found:
        # Every name under a wrapper's prefix (`module.` of DDP)? Say which, not "0 layers".
        outer = next((k for k in sorted(stored) if "." + prefix in k), None)
        if outer is not None:
            cut = outer.index("." + prefix) + 1
            raise CheckpointError(
                f"{config.parent}: no tensor named {prefix}* (the files have {outer!r}: saved under the prefix "
                f"{outer[:cut]!r}; strip it from every name)"
            )

    def dense(layers: set[int]) -> bool:  # exactly 0..n-1 (no set of a config's 10^9 layers)
        return not layers or max(layers) == len(layers) - 1

    if len(found) != num_layers or not dense(found):
        held = f"layers 0..{max(found)}" if found and dense(found) else f"{len(found)} layer indices"
        raise CheckpointError(
            f"{config} says num_hidden_layers {num_layers}, the weights hold {held} under {prefix!r}: "
            f"the config is not these weights' config"
        )


def check_shapes(
    stored: Mapping[str, StoredTensor], want: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Each stored tensor of `want` (file name -> full shape) has that shape and a float dtype;
    `source` says where the expectation comes from (a config file)."""
    for key, shape in want.items():
        found = stored.get(key)
        if found is None:
            continue  # missing tensors are named by the loaders, with their hints
        if found.shape != tuple(shape):
            raise CheckpointError(
                f"{key}: shape {found.shape} in {found.path.name}, the model expects {tuple(shape)} (from {source})"
            )
        check_float(key, found)


def missing_hint(key: str, present: Iterable[str]) -> str:
    """A hint for a tensor not found: the files' name for it under a prefix (`module.`,
    `_orig_mod.`, a wrapper's name), else nothing."""
    for name in present:
        if name.endswith("." + key):
            prefix = name[: -len(key)]
            return f" (the files have {name!r}: saved under the prefix {prefix!r}; strip it from every name)"
    return ""


# ---------------------------------------------------------------------------------------------
# Llama-family config.json
# ---------------------------------------------------------------------------------------------


def ar_config_from_hf(config: Mapping[str, Any]) -> ArConfig:
    """ArConfig of a Hugging Face Llama/Qwen2 `config.json`."""
    archs = " ".join(config.get("architectures", []))
    # transformers >= 5 nests RoPE settings under rope_parameters; older files use rope_theta and
    # rope_scaling. Only plain RoPE is built in: a scaled variant (llama3, yarn, ...) would give
    # K at the wrong angles without any error, so it is refused here.
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported by the built-in AR (plain RoPE only)"
        )
    rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    return ArConfig(
        num_layers=int(config["num_hidden_layers"]),
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads", num_heads)),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        mlp=int(config["intermediate_size"]),
        vocab=int(config["vocab_size"]),
        max_tokens=int(config.get("max_position_embeddings", 4096)),
        rope_theta=rope_theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(config.get("attention_bias", False))
        or "Qwen2" in archs
        or config.get("model_type") == "qwen2",
    )


def ar_config_to_hf(cfg: ArConfig) -> dict[str, Any]:
    """A Llama `config.json` for a built-in AR shape (Qwen2 when it has q/k/v biases)."""
    return {
        "architectures": ["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if cfg.qkv_bias else "llama",
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp,
        "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.max_tokens,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "attention_bias": cfg.qkv_bias,
        "hidden_act": "silu",
    }


def read_hf_config(directory: str | Path) -> ArConfig:
    path = require_dir(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    try:
        config = read_json_file(path)
    except ValueError as err:  # FileRefused, not JSON: both name the file already
        raise CheckpointError(str(err)) from None
    problem = hf_family_problem(config)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    return ar_config_from_file(config, path)


def check_hf_checkpoint(directory: str | Path, cfg: ArConfig) -> None:
    """The files of a Llama/Qwen2 directory fit its config.json (layer count, every shape, float
    dtypes), from the headers alone: run before the model is allocated, so a config that is not
    the weights' (hidden_size 35840 for 3584) is named rather than allocated out of memory."""
    config = require_dir(directory) / "config.json"
    stored = scan_tensors(*checkpoint_layout(directory))
    check_layer_count(stored, "model.layers.", cfg.num_layers, config)
    check_shapes(stored, llama_shapes(cfg), str(config.name))


def ar_config_from_file(config: Mapping[str, Any], path: Path) -> ArConfig:
    """`ar_config_from_hf`, a key it needs that is absent or not a number a CheckpointError
    naming the file and the key."""
    try:
        return ar_config_from_hf(config)
    except KeyError as err:
        raise CheckpointError(f"{path}: no {err.args[0]!r}: not a Llama/Qwen2 config") from None
    except (TypeError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise CheckpointError(f"{path}: {err}") from None
        raise CheckpointError(f"{path}: not a Llama/Qwen2 config ({type(err).__name__}: {err})") from None
