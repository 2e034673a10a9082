"""Model presets: the typed shapes of the built-in AR and DiT models.

Owns the numbers that AR and DiT of one deployment must agree on (num_layers, num_kv_heads,
head_dim, dtype: the KV geometry of DESIGN.md section 3) and each stage's own shape. Pure Python:
importing this module must never import torch, so configs and the CLI can read presets cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvrelay.suggest import did_you_mean

if TYPE_CHECKING:  # the geometry type lives in the transfer core (issue 4); imported lazily below
    from kvrelay.transfer.layout import KvGeometry

DTypeName = Literal["bfloat16", "float16", "float32"]

# Byte-level tokenizer (kvrelay/models/tokenizer.py): ids 0..255 are raw bytes, then the specials.
BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_TOKENIZER_VOCAB = BYTE_VOCAB + 3


def _check_heads(where: str, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(f"{where}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if hidden <= 0 or head_dim <= 0 or head_dim % 2:
        # RoPE rotates pairs of channels, so head_dim must be even.
        raise ValueError(f"{where}: hidden={hidden} and head_dim={head_dim} must be positive, head_dim even")


@dataclass(frozen=True, slots=True)
class ArConfig:
    """Llama-style decoder shape (Llama/Qwen2 checkpoint names load into it, see models/loader.py)."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp: int
    vocab: int = BYTE_TOKENIZER_VOCAB
    max_tokens: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Qwen2-family checkpoints carry biases on q/k/v; Llama has none.
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        _check_heads("ArConfig", self.hidden, self.num_heads, self.num_kv_heads, self.head_dim)
        if self.max_tokens <= 0 or self.vocab <= 0 or self.num_layers <= 0:
            raise ValueError("ArConfig: num_layers, vocab and max_tokens must be positive")


@dataclass(frozen=True, slots=True)
class DitConfig:
    """Diffusion transformer shape. Image latents are `latent_downsample` times smaller than the
    image and cut into `patch_size` x `patch_size` patches, one token each: 512x512 -> 64x64
    latents -> 32x32 = 1024 tokens with the defaults."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp: int
    latent_channels: int = 4
    patch_size: int = 2
    latent_downsample: int = 8
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Mixture of experts (HunyuanImage-3 style): 0 = the dense SwiGLU MLP of size `mlp`. Otherwise
    # each block's MLP is `experts_top_k` of `num_experts` routed SwiGLU experts of size
    # `expert_mlp` (softmax router, top-k weights renormalized) plus one shared expert of size `mlp`.
    num_experts: int = 0
    experts_top_k: int = 0
    expert_mlp: int = 0

    def __post_init__(self) -> None:
        _check_heads("DitConfig", self.hidden, self.num_heads, self.num_kv_heads, self.head_dim)
        if self.num_experts < 0 or (self.num_experts and not 0 < self.experts_top_k <= self.num_experts):
            raise ValueError(
                f"DitConfig: experts_top_k={self.experts_top_k} must be in 1..num_experts={self.num_experts}"
            )
        if self.num_experts and self.expert_mlp <= 0:
            raise ValueError("DitConfig: a MoE DiT needs expert_mlp > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def latent_size(self, width: int, height: int) -> tuple[int, int]:
        """(latent_height, latent_width) of an image; width/height must divide evenly."""
        step = self.latent_downsample * self.patch_size
        if width % step or height % step:
            raise ValueError(f"width={width} and height={height} must be multiples of {step}")
        return height // self.latent_downsample, width // self.latent_downsample

    def num_image_tokens(self, width: int, height: int) -> int:
        lh, lw = self.latent_size(width, height)
        return (lh // self.patch_size) * (lw // self.patch_size)


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A named pair of AR and DiT shapes that share one KV geometry (the DiT's layer i attends over
    the AR's layer i prefix, so layers, kv heads, head_dim and dtype must be equal)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DTypeName
    ar: ArConfig
    dit: DitConfig
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for stage, cfg in (("ar", self.ar), ("dit", self.dit)):
            for name in ("num_layers", "num_kv_heads", "head_dim"):
                if getattr(cfg, name) != getattr(self, name):
                    raise ValueError(
                        f"preset {self.name!r}: {stage}.{name}={getattr(cfg, name)} differs from the "
                        f"shared KV geometry {name}={getattr(self, name)}"
                    )

    def kv_geometry(self, page_size: int) -> KvGeometry:
        """The KV geometry of this preset with the DiT's `page_size`."""
        from kvrelay.transfer.layout import KvGeometry

        return KvGeometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page_size,
        )

    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


def _preset(
    name: str,
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    mlp: int,
    dtype: DTypeName,
    max_tokens: int,
    latent_channels: int,
    description: str,
    num_experts: int = 0,
    experts_top_k: int = 0,
    expert_mlp: int = 0,
) -> ModelPreset:
    # The DiT mirrors the AR's transformer shape, as BAGEL's generation expert does (MoT).
    ar = ArConfig(
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        mlp=mlp,
        max_tokens=max_tokens,
    )
    dit = DitConfig(
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        mlp=mlp,
        latent_channels=latent_channels,
        num_experts=num_experts,
        experts_top_k=experts_top_k,
        expert_mlp=expert_mlp,
    )
    return ModelPreset(
        name=name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        ar=ar,
        dit=dit,
        description=description,
    )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # Tests: 4 kv heads so TP=1/2/4 all divide, GQA group of 2 so grouping is exercised.
        _preset(
            "tiny",
            num_layers=2,
            hidden=128,
            num_heads=8,
            num_kv_heads=4,
            head_dim=16,
            mlp=256,
            dtype="float32",
            max_tokens=256,
            latent_channels=4,
            description="unit tests: 2 layers, hidden 128, fp32",
        ),
        # CPU default of `kvrelay up`: a 512x512, 2-step generation in seconds on 2 cores.
        _preset(
            "small",
            num_layers=4,
            hidden=256,
            num_heads=8,
            num_kv_heads=4,
            head_dim=32,
            mlp=768,
            dtype="float32",
            max_tokens=1024,
            latent_channels=4,
            description="CPU default: 4 layers, hidden 256, fp32",
        ),
        # GPU benchmarks: the shape of BAGEL-7B (Qwen2-7B LLM, MoT generation expert of equal shape).
        _preset(
            "bagel-7b-shape",
            num_layers=28,
            hidden=3584,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            mlp=18944,
            dtype="bfloat16",
            max_tokens=4096,
            latent_channels=16,
            description="GPU benchmarks: BAGEL-7B shape, 28 layers, hidden 3584, bf16",
        ),
        # MoE tests: the tiny shape with 4 routed experts (top 2) and a shared expert in the DiT.
        _preset(
            "tiny-moe",
            num_layers=2,
            hidden=128,
            num_heads=8,
            num_kv_heads=4,
            head_dim=16,
            mlp=64,
            dtype="float32",
            max_tokens=256,
            latent_channels=4,
            num_experts=4,
            experts_top_k=2,
            expert_mlp=64,
            description="MoE unit tests: tiny with 4 routed experts (top 2) + a shared expert, fp32",
        ),
        # GPU: HunyuanImage-3's per-layer shape (hidden 4096, 32/8 heads, 64 experts top 8 of
        # 3072 + one shared expert of 3072) with 8 of its 32 layers, so one H200 holds it (~20B
        # DiT parameters, ~42 GB bf16). The AR of the pair is dense (mlp = the shared expert's).
        _preset(
            "hunyuan-moe-shape",
            num_layers=8,
            hidden=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            mlp=3072,
            dtype="bfloat16",
            max_tokens=4096,
            latent_channels=16,
            num_experts=64,
            experts_top_k=8,
            expert_mlp=3072,
            description="GPU: HunyuanImage-3 MoE layer shape, 8 layers, 64 experts top 8, bf16",
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}{did_you_mean(name, PRESETS)}; known presets: {', '.join(PRESETS)}"
        ) from None
