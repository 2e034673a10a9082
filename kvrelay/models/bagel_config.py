"""A BAGEL-format checkpoint directory's shape, read without torch: `llm_config.json` (Qwen2),
the special tokens of its `tokenizer.json`, the latent shapes its weights imply (safetensors
headers: `vae2llm`, `latent_pos_embed`) and `kvrelay.json` overrides, each checked against the
others with a CheckpointError naming the file.

The AR and DiT services read it before they spawn their ranks (the DiT's page geometry and
largest image, the AR's prompt wrapping), and a service process imports no torch: its ranks do
(kvrelay.models.bagel: the modules and the strict load, which re-exports what it uses of this).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvrelay.limits import MAX_TOKENIZER_FILE_BYTES, read_json_file
from kvrelay.models.checkpoint import (
    CheckpointError,
    StoredTensor,
    WeightIndex,
    ar_config_from_file,
    check_layer_count,
    missing_hint,
    no_weights_error,
    read_index,
    require_dir,
    scan_tensors,
)
from kvrelay.models.presets import ArConfig, DitConfig, DTypeName, ModelPreset

LLM_CONFIG_FILE = "llm_config.json"
KVRELAY_CONFIG_FILE = "kvrelay.json"  # optional overrides: sampler defaults, VAE kind (demo, tests)
EMA_FILE = "ema.safetensors"
VAE_FILE = "ae.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LLM = "language_model.model."

# BAGEL's special tokens (data/data_utils.add_special_tokens): the prompt is wrapped in
# <|im_start|> ... <|im_end|>; an image is bracketed by <|vision_start|> ... <|vision_end|>.
BOS_TOKEN, EOS_TOKEN = "<|im_start|>", "<|im_end|>"
START_OF_IMAGE, END_OF_IMAGE = "<|vision_start|>", "<|vision_end|>"


@dataclass(frozen=True, slots=True)
class BagelConfig:
    """Shapes and sampler defaults of one BAGEL-format checkpoint directory."""

    llm: ArConfig
    dtype: DTypeName = "bfloat16"
    latent_channels: int = 16  # FLUX VAE z_channels
    latent_patch_size: int = 2
    vae_downsample: int = 8
    max_latent_size: int = 64  # latent patches per side covered by latent_pos_embed
    # BAGEL's text-to-image defaults (inferencer / app.py).
    timestep_shift: float = 3.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    cfg_renorm_type: str = "global"
    start_of_image: int = 151652
    end_of_image: int = 151653
    vae: dict[str, Any] = field(default_factory=lambda: {"kind": "flux"}, compare=False)

    @property
    def patch_dim(self) -> int:
        return self.latent_patch_size**2 * self.latent_channels

    @property
    def latent_downsample(self) -> int:
        """Image pixels per latent token along each side (VAE factor x latent patch)."""
        return self.vae_downsample * self.latent_patch_size

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of latent tokens of an image; sizes must divide by latent_downsample."""
        step = self.latent_downsample
        if width % step or height % step or width <= 0 or height <= 0:
            raise ValueError(f"width={width} and height={height} must be positive multiples of {step}")
        h, w = height // step, width // step
        if h > self.max_latent_size or w > self.max_latent_size:
            raise ValueError(
                f"{width}x{height} needs {w}x{h} latent patches; the model's position table covers "
                f"{self.max_latent_size} per side (at most {self.max_latent_size * step} pixels)"
            )
        return h, w

    def preset(self, name: str = "bagel") -> ModelPreset:
        """The KV geometry and stage shapes as a ModelPreset (what pages and registration use)."""
        llm = self.llm
        dit = DitConfig(
            num_layers=llm.num_layers,
            hidden=llm.hidden,
            num_heads=llm.num_heads,
            num_kv_heads=llm.num_kv_heads,
            head_dim=llm.head_dim,
            mlp=llm.mlp,
            latent_channels=self.latent_channels,
            patch_size=self.latent_patch_size,
            latent_downsample=self.vae_downsample,
            rope_theta=llm.rope_theta,
            norm_eps=llm.norm_eps,
        )
        return ModelPreset(
            name=name,
            num_layers=llm.num_layers,
            num_kv_heads=llm.num_kv_heads,
            head_dim=llm.head_dim,
            dtype=self.dtype,
            ar=llm,
            dit=dit,
            description=f"BAGEL-format checkpoint ({llm.num_layers} layers, hidden {llm.hidden})",
        )


def weight_layout(directory: str | Path) -> tuple[list[Path], WeightIndex | None]:
    """The weight files of a BAGEL directory: `ema.safetensors` (the published release), else the
    files of `model.safetensors.index.json` (and the index), else every `*.safetensors` except
    the VAE."""
    d = require_dir(directory)
    if (d / EMA_FILE).is_file():
        return [d / EMA_FILE], None
    if (d / INDEX_FILE).is_file():
        return read_index(d / INDEX_FILE)
    files = sorted(p for p in d.glob("*.safetensors") if p.name != VAE_FILE)
    if not files:
        raise no_weights_error(d, f"{EMA_FILE}, {INDEX_FILE} or other *.safetensors weights")
    return files, None


def weight_files(directory: str | Path) -> list[Path]:
    return weight_layout(directory)[0]


def stored_tensors(directory: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the directory's weight files (headers only; see `scan_tensors`)."""
    return scan_tensors(*weight_layout(directory))


def _json(path: Path, max_bytes: int | None = None) -> Any:
    try:
        return read_json_file(path) if max_bytes is None else read_json_file(path, max_bytes)
    except ValueError as err:  # FileRefused, not JSON: both name the file already
        raise CheckpointError(str(err)) from None


def _special_ids(directory: Path) -> dict[str, int]:
    """Ids of BAGEL's special tokens from the directory's tokenizer.json (added tokens)."""
    path = directory / "tokenizer.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"{directory} has no tokenizer.json (the Qwen2 tokenizer of the release)")
    # The tokenizer's bound, as when the AR reads the same file (kvrelay.models.tokenizer).
    data = _json(path, MAX_TOKENIZER_FILE_BYTES)
    try:
        ids = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
        vocab = data.get("model", {}).get("vocab", {})
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        # Before the ranks start, in the DiT service: one line naming the file, not a traceback.
        what = f"no {err.args[0]!r}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise CheckpointError(
            f"{path}: not a Hugging Face tokenizer.json ({what}; added_tokens: [{{content, id}}], model.vocab)"
        ) from None
    out = {}
    for name in (BOS_TOKEN, EOS_TOKEN, START_OF_IMAGE, END_OF_IMAGE):
        token_id = ids.get(name, vocab.get(name) if isinstance(vocab, dict) else None)
        if token_id is None:
            raise CheckpointError(f"{path}: no special token {name!r}")
        out[name] = int(token_id)
    return out


def load_bagel_config(directory: str | Path, *, dtype: DTypeName | None = None) -> BagelConfig:
    """Read `llm_config.json` (Qwen2), the special tokens, the latent shapes implied by the
    weights (`vae2llm`, `latent_pos_embed`) and optional `kvrelay.json` overrides."""
    d = require_dir(directory)
    llm_path = d / LLM_CONFIG_FILE
    if not llm_path.is_file():
        raise CheckpointError(f"{d} has no {LLM_CONFIG_FILE}: not a BAGEL checkpoint directory")
    raw = _json(llm_path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{llm_path}: not a JSON object")
    module = raw.get("layer_module", "Qwen2MoTDecoderLayer")
    if module != "Qwen2MoTDecoderLayer":
        raise CheckpointError(f"{llm_path}: layer_module {module!r}; only the MoT layout is supported")
    llm = ar_config_from_file(
        {**raw, "architectures": raw.get("architectures") or ["Qwen2ForCausalLM"]}, llm_path
    )
    # BAGEL's Qwen2 always has q/k/v biases (the inference code builds Qwen2 with them).
    llm = replace(llm, qkv_bias=True)
    shapes = stored_tensors(d)
    special = _special_ids(d)
    extra: dict[str, Any] = _json(d / KVRELAY_CONFIG_FILE) if (d / KVRELAY_CONFIG_FILE).is_file() else {}
    vae = dict(extra.get("vae") or {"kind": "flux"})
    patch = int(extra.get("latent_patch_size", 2))
    if "vae2llm.weight" not in shapes:
        raise CheckpointError(
            f"{d}: checkpoint has no tensor 'vae2llm.weight'{missing_hint('vae2llm.weight', shapes)}"
        )
    if len(shapes["vae2llm.weight"].shape) != 2:
        raise CheckpointError(f"vae2llm.weight: shape {shapes['vae2llm.weight'].shape}, a matrix expected")
    patch_dim = shapes["vae2llm.weight"].shape[1]
    # Headers against llm_config.json before anything of its size is built (or iterated over).
    check_layer_count(shapes, f"{LLM}layers.", llm.num_layers, llm_path)
    embed = shapes.get(f"{LLM}embed_tokens.weight")
    if embed is not None and embed.shape != (llm.vocab, llm.hidden):
        raise CheckpointError(
            f"{LLM}embed_tokens.weight: shape {embed.shape} in {embed.path.name}, {llm_path.name} says "
            f"vocab_size x hidden_size = {(llm.vocab, llm.hidden)}"
        )
    if patch_dim % (patch * patch):
        raise CheckpointError(f"vae2llm.weight: input dim {patch_dim} is not latent_patch_size^2 x channels")
    channels = patch_dim // (patch * patch)
    max_latent = int(extra.get("max_latent_size", 64))
    if "latent_pos_embed.pos_embed" in shapes:
        rows = shapes["latent_pos_embed.pos_embed"].shape[0]
        side = math.isqrt(rows)
        if side * side != rows:
            raise CheckpointError(f"latent_pos_embed.pos_embed: {rows} rows is not a square grid")
        max_latent = side
    kind = vae.get("kind", "flux")
    if kind == "autoencoder_kl":
        default_downsample = 2 ** (len(vae["config"]["down_block_types"]) - 1)
    elif kind == "pixel":
        default_downsample = int(vae["downsample"])
    else:
        default_downsample = 8  # FLUX
    sampler = dict(extra.get("sampler") or {})
    interval = sampler.get("cfg_interval", (0.4, 1.0))
    return BagelConfig(
        llm=llm,
        dtype=dtype or extra.get("dtype", "bfloat16"),
        latent_channels=channels,
        latent_patch_size=patch,
        vae_downsample=default_downsample,
        max_latent_size=max_latent,
        timestep_shift=float(sampler.get("timestep_shift", 3.0)),
        cfg_interval=(float(interval[0]), float(interval[1])),
        cfg_renorm_min=float(sampler.get("cfg_renorm_min", 0.0)),
        cfg_renorm_type=str(sampler.get("cfg_renorm_type", "global")),
        start_of_image=special[START_OF_IMAGE],
        end_of_image=special[END_OF_IMAGE],
        vae=vae,
    )
