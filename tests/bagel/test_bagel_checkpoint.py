"""BAGEL-format checkpoints without downloads: a tiny checkpoint with the release's names and
layout is written at test time, then loaded through `format: bagel`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvrelay.models.bagel import (
    LLM,
    BagelDit,
    ar_tensors,
    build_ar,
    dit_tensors,
    load_bagel_config,
    load_dit,
    sincos_2d_table,
    stage_preset,
)
from kvrelay.models.bagel_runner import BagelDitRunner, guided_velocity
from kvrelay.models.formats import bagel_geometry, model_dir
from kvrelay.models.loader import CheckpointError
from kvrelay.models.parallel import TpGroup
from kvrelay.models.tokenizer import BagelTokenizer, load_tokenizer

from .tiny import WORDS, tiny_config, write_tiny_bagel


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bagel(tmp_path_factory.mktemp("bagel") / "BAGEL-tiny")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_config_from_the_release_files(tiny_dir: Path) -> None:
    cfg = load_bagel_config(tiny_dir)
    want = tiny_config()
    assert cfg.llm == want.llm
    assert (cfg.latent_channels, cfg.latent_patch_size, cfg.vae_downsample, cfg.max_latent_size) == (4, 2, 2, 8)
    assert (cfg.start_of_image, cfg.end_of_image) == (want.start_of_image, want.end_of_image)
    assert cfg.timestep_shift == 3.0 and cfg.cfg_interval == (0.4, 1.0) and cfg.cfg_renorm_type == "global"
    preset = cfg.preset()
    assert (preset.num_layers, preset.num_kv_heads, preset.head_dim, preset.dtype) == (2, 4, 8, "float32")


def test_tokenizer_wraps_the_prompt_as_bagel(tiny_dir: Path) -> None:
    tok = BagelTokenizer(tiny_dir)
    vocab = json.loads((tiny_dir / "tokenizer.json").read_text())["model"]["vocab"]
    ids = tok.encode("A red circle")
    assert ids == [tok.bos_id, vocab["a"], vocab["red"], vocab["circle"], tok.eos_id]
    assert tok.encode("") == [tok.bos_id, tok.eos_id]  # the unconditional row
    assert tok.bos_id != tok.eos_id and len(WORDS) < tok.vocab_size


def test_every_rank_holds_its_shard_of_the_file(tiny_dir: Path) -> None:
    cfg = load_bagel_config(tiny_dir)
    full = {**load_file(str(tiny_dir / "ema.safetensors"))}
    for world in (1, 2, 4):
        for rank in range(world):
            tp = TpGroup(rank, world, None)
            ar = build_ar(tiny_dir, tp=tp)
            dit = load_dit(tiny_dir, cfg, BagelDit(cfg, tp, dtype=torch.float32, device="cpu"))
            for module, specs in ((ar, ar_tensors(cfg)), (dit, dit_tensors(cfg))):
                params = dict(module.named_parameters())
                for spec in specs:
                    want = full[spec.file_key]
                    if spec.shard_dim is not None:
                        want = tp.shard(want, spec.shard_dim)
                    assert torch.equal(params[spec.model_key], want), (world, rank, spec.file_key)
            embed = full[f"{LLM}embed_tokens.weight"]
            assert torch.equal(dit.marker_embed, embed[[cfg.start_of_image, cfg.end_of_image]])
            assert torch.equal(dit.latent_pos_embed.pos_embed, full["latent_pos_embed.pos_embed"])


def test_kv_matches_transformers_qwen3_attention(tiny_dir: Path) -> None:
    """The understanding expert is Qwen2 with QK-norm: transformers' Qwen3 with q/k/v biases (o_proj
    bias zero) computes the same layer, so its KV cache must equal our prefill."""
    transformers = pytest.importorskip("transformers")
    cfg = load_bagel_config(tiny_dir)
    llm = cfg.llm
    hf_cfg = transformers.Qwen3Config(
        vocab_size=llm.vocab, hidden_size=llm.hidden, intermediate_size=llm.mlp,
        num_hidden_layers=llm.num_layers, num_attention_heads=llm.num_heads,
        num_key_value_heads=llm.num_kv_heads, head_dim=llm.head_dim, rms_norm_eps=llm.norm_eps,
        rope_theta=llm.rope_theta, attention_bias=True, max_position_embeddings=llm.max_tokens,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    state = load_file(str(tiny_dir / "ema.safetensors"))
    mapped = {k.removeprefix("language_model."): v for k, v in state.items() if k.startswith(LLM)}
    mapped = {k: v for k, v in mapped.items() if "_moe_gen" not in k}
    for i in range(llm.num_layers):
        mapped[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(llm.hidden)
    missing, _ = hf.load_state_dict(mapped, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing
    ids = BagelTokenizer(tiny_dir).encode("a blue square on the red background top left")
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    ours = build_ar(tiny_dir).prefill(ids)
    for layer in range(llm.num_layers):
        k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        torch.testing.assert_close(ours[layer, 0], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[layer, 1], v, atol=1e-5, rtol=1e-5)


def test_ar_prefill_and_dit_steps_end_to_end(tiny_dir: Path) -> None:
    tok = BagelTokenizer(tiny_dir)
    ar = build_ar(tiny_dir)
    rows = []
    for text in ("a red circle on the blue background top left", ""):
        kv = ar.prefill(tok.encode(text))
        rows.append([(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])])
    runner = BagelDitRunner(tiny_dir)
    steps_seen: list[int] = []
    latents = runner.denoise(rows, width=16, height=8, steps=3, guidance_scale=4.0, seed=5,
                             on_step=lambda k, n: steps_seen.append(k))
    assert steps_seen == [1, 2, 3]
    assert latents.shape == (4, 4, 8) and torch.isfinite(latents).all()
    again = runner.denoise(rows, width=16, height=8, steps=3, guidance_scale=4.0, seed=5)
    assert torch.equal(latents, again)
    other = runner.denoise(rows, width=16, height=8, steps=3, guidance_scale=4.0, seed=6)
    assert not torch.equal(latents, other)
    image = runner.decode(latents)
    assert image.shape == (8, 16, 3) and image.dtype == torch.uint8
    # The prompt matters: a different prefix gives a different velocity, hence latents.
    kv = ar.prefill(tok.encode("a green square on the white background bottom right"))
    rows2 = [[(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])], rows[1]]
    assert not torch.equal(latents, runner.denoise(rows2, width=16, height=8, steps=3, guidance_scale=4.0, seed=5))


def test_dit_matches_a_single_sequence_reference(tiny_dir: Path) -> None:
    """BAGEL's _forward_flow by hand, as one packed sequence [prompt | start, latents, end]
    through the shared layers: the split AR prefix + DiT query must give the same velocity."""
    cfg = load_bagel_config(tiny_dir)
    ids = BagelTokenizer(tiny_dir).encode("a red circle on the blue background")
    ar = build_ar(tiny_dir)
    dit = load_dit(tiny_dir, cfg, BagelDit(cfg, dtype=torch.float32, device="cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, cfg.patch_dim, generator=gen)
    t = torch.tensor([0.7])
    pos = dit.position_ids(2, 3)
    kv = ar.prefill(ids)
    prefix = [[(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]]
    ours = dit(x, t, pos, prefix, [len(ids)])

    # Reference: one sequence, explicit masks and expert routing, float64.
    from kvrelay.models.layers import apply_rotary, rope_cos_sin

    llm = cfg.llm
    d = {k: v.double() for k, v in load_file(str(tiny_dir / "ema.safetensors")).items()}

    def lin(name: str, h: torch.Tensor) -> torch.Tensor:
        out = h @ d[name + ".weight"].T
        return out + d[name + ".bias"] if name + ".bias" in d else out

    def rms(name: str, h: torch.Tensor) -> torch.Tensor:
        return d[name + ".weight"] * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + llm.norm_eps)

    from kvrelay.models.bagel import timestep_features

    n_text, n = len(ids), 6
    temb = lin("time_embedder.mlp.2", torch.nn.functional.silu(lin("time_embedder.mlp.0", timestep_features(t).double())))
    lat = lin("vae2llm", x[0].double()) + temb + d["latent_pos_embed.pos_embed"][pos]
    embed = d[f"{LLM}embed_tokens.weight"]
    h = torch.cat([embed[ids], embed[[cfg.start_of_image]], lat, embed[[cfg.end_of_image]]])
    total = n_text + n + 2
    gen_tok = torch.zeros(total, dtype=torch.bool)
    gen_tok[n_text + 1 : n_text + 1 + n] = True
    positions = torch.tensor(list(range(n_text)) + [n_text] * (n + 2))
    mask = torch.ones(total, total, dtype=torch.bool).tril()
    mask[n_text:, :] = True  # the image query sees the prompt and the whole query
    cos, sin = rope_cos_sin(positions, llm.head_dim, llm.rope_theta, dtype=torch.float64)
    for i in range(llm.num_layers):
        p = f"{LLM}layers.{i}."

        def heads(t: torch.Tensor, k: int) -> torch.Tensor:
            return t.view(total, k, llm.head_dim).transpose(0, 1)

        normed = torch.where(gen_tok[:, None], rms(p + "input_layernorm_moe_gen", h), rms(p + "input_layernorm", h))
        qkv = {}
        for name, k in (("q", llm.num_heads), ("k", llm.num_kv_heads), ("v", llm.num_kv_heads)):
            und = heads(lin(p + f"self_attn.{name}_proj", normed), k)
            g = heads(lin(p + f"self_attn.{name}_proj_moe_gen", normed), k)
            if name != "v":
                und, g = rms(p + f"self_attn.{name}_norm", und), rms(p + f"self_attn.{name}_norm_moe_gen", g)
            qkv[name] = torch.where(gen_tok[None, :, None], g, und)
        q = apply_rotary(qkv["q"], cos, sin)
        k = apply_rotary(qkv["k"], cos, sin).repeat_interleave(2, 0)
        v = qkv["v"].repeat_interleave(2, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(0, 1).reshape(total, -1)
        h = h + torch.where(gen_tok[:, None], lin(p + "self_attn.o_proj_moe_gen", o), lin(p + "self_attn.o_proj", o))
        normed = torch.where(gen_tok[:, None], rms(p + "post_attention_layernorm_moe_gen", h), rms(p + "post_attention_layernorm", h))

        def mlp(prefix: str, z: torch.Tensor) -> torch.Tensor:
            return lin(prefix + ".down_proj", torch.nn.functional.silu(lin(prefix + ".gate_proj", z)) * lin(prefix + ".up_proj", z))

        h = h + torch.where(gen_tok[:, None], mlp(p + "mlp_moe_gen", normed), mlp(p + "mlp", normed))
    out = lin("llm2vae", rms(f"{LLM}norm_moe_gen", h))[gen_tok]
    torch.testing.assert_close(ours[0].double(), out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "edit, message",
    [
        ("rename", "missing tensor 'language_model.model.layers.1.self_attn.k_proj_moe_gen.weight'"),
        ("drop", "missing tensor 'llm2vae.bias'"),
        ("extra", "unexpected tensor 'language_model.model.layers.0.self_attn.extra.weight'"),
        ("shape", "language_model.model.layers.0.mlp_moe_gen.up_proj.weight: shape (97, 64)"),
    ],
)
def test_a_broken_checkpoint_names_the_tensor(tiny_dir: Path, tmp_path: Path, edit: str, message: str) -> None:
    d = _copy(tiny_dir, tmp_path / "broken")
    state = load_file(str(d / "ema.safetensors"))
    if edit == "rename":
        key = f"{LLM}layers.1.self_attn.k_proj_moe_gen.weight"
        state[key.replace("k_proj_moe_gen", "k_proj_gen")] = state.pop(key)
    elif edit == "drop":
        del state["llm2vae.bias"]
    elif edit == "extra":
        state[f"{LLM}layers.0.self_attn.extra.weight"] = torch.zeros(2)
    else:
        state[f"{LLM}layers.0.mlp_moe_gen.up_proj.weight"] = torch.zeros(97, 64)
    save_file(state, str(d / "ema.safetensors"))
    cfg = load_bagel_config(d)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_dit(d, cfg, BagelDit(cfg, dtype=torch.float32, device="cpu"))
    if edit != "shape":  # the AR checks every name too (its own tensors' shapes only)
        with pytest.raises(CheckpointError, match=message.split("'")[0]):
            build_ar(d)


def test_sharded_index_layout_and_dropped_position_table(tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "sharded"
    d.mkdir()
    for name in ("llm_config.json", "tokenizer.json", "kvrelay.json", "ae.safetensors"):
        shutil.copy(tiny_dir / name, d / name)
    state = load_file(str(tiny_dir / "ema.safetensors"))
    del state["latent_pos_embed.pos_embed"]  # rebuilt from sin-cos, as BAGEL's constructor does
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for file, names in halves.items():
        save_file({k: state[k] for k in names}, str(d / file))
        weight_map.update({k: file for k in names})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = load_bagel_config(d)
    assert cfg.max_latent_size == 64  # BAGEL-7B-MoT's, when the table does not say otherwise
    dit = load_dit(d, cfg, BagelDit(cfg, dtype=torch.float32, device="cpu"))
    assert torch.allclose(dit.latent_pos_embed.pos_embed, sincos_2d_table(64, 64))
    with safe_open(str(tiny_dir / "ema.safetensors"), framework="pt") as f:
        assert torch.allclose(f.get_tensor("latent_pos_embed.pos_embed"), sincos_2d_table(8, 64), atol=1e-6)


def test_model_formats_resolve(tiny_dir: Path) -> None:
    from kvrelay.config import ModelConfig

    model = ModelConfig(format="bagel", path=str(tiny_dir))
    assert model_dir(model) == str(tiny_dir)
    assert stage_preset(model).num_layers == 2
    assert bagel_geometry(model) == (2, 4, 8, "float32")
    assert bagel_geometry(ModelConfig(format="bagel", path=str(tiny_dir / "not-here"))) is None
    assert isinstance(load_tokenizer(None, model=model), BagelTokenizer)
    with pytest.raises(ValueError, match="model.path"):
        ModelConfig(format="bagel")
    with pytest.raises(ValueError, match="preset does not apply"):
        ModelConfig(format="bagel", path="x", preset="tiny")


def test_guided_velocity_is_bagels_renormalized_cfg() -> None:
    gen = torch.Generator().manual_seed(0)
    c, u = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    g = guided_velocity(c, u, 4.0)
    raw = u + 4.0 * (c - u)
    assert torch.allclose(g, raw * (c.norm() / raw.norm()).clamp(max=1.0))
    assert torch.allclose(g.norm(), c.norm())  # scaled down to the conditional norm
    assert torch.equal(guided_velocity(c, u, 4.0, renorm_type="none"), raw)
    # a guided velocity already smaller than the conditional one is left alone
    assert torch.allclose(guided_velocity(c, 2.0 * c, 1.2), 0.8 * c)


def test_unused_parts_of_the_release_are_ignored(tiny_dir: Path) -> None:
    names = set(load_file(str(tiny_dir / "ema.safetensors")))
    assert {"language_model.lm_head.weight", "vit_pos_embed.pos_embed", "connector.fc1.weight"} <= names
    build_ar(tiny_dir)  # no error: those tensors are on the unused list


def test_batched_denoise_is_each_request_alone(tiny_dir: Path) -> None:
    """The service's batching (max_num_seqs > 1): one forward per step over every request's rows,
    prefixes of different lengths, one request with CFG and one without, one stopped early."""
    from kvrelay.models.dit import BatchRequest

    tok = BagelTokenizer(tiny_dir)
    ar = build_ar(tiny_dir)

    def row(text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kv = ar.prefill(tok.encode(text))
        return [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])]

    runner = BagelDitRunner(tiny_dir)
    reqs = [
        BatchRequest([row("a red circle on the blue background top left"), row("")], 4.0, 1),
        BatchRequest([row("green square")], 1.0, 2),
        BatchRequest([row("a blue circle"), row("")], 2.0, 3),
    ]
    alone = [runner.denoise(r.prefix_rows, width=16, height=8, steps=3, guidance_scale=r.guidance_scale, seed=r.seed)
             for r in reqs]
    seen: list[tuple[int, list[int]]] = []

    def on_step(k: int, total: int, active: list[int]) -> set[int]:
        seen.append((k, active))
        return {2} if k == 1 else set()

    together = runner.denoise_batch(reqs, width=16, height=8, steps=3, on_step=on_step)
    assert seen == [(1, [0, 1, 2]), (2, [0, 1]), (3, [0, 1])]
    assert together[2] is None
    for got, want in zip(together[:2], alone[:2], strict=True):
        assert got is not None
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
