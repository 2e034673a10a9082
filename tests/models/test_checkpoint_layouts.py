"""Checkpoints as users bring them (Hugging Face Llama/Qwen2 directories, the DiT's own format):
every layout that is right loads the same model; every broken one is refused at load, naming
the file, the tensor and what was expected, never loaded as garbage nor failing without a hint."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.models.ar import build_ar_model
from kvrelay.models.loader import CheckpointError

IDS = list(range(40, 72))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama directory as `save_pretrained` leaves it: config.json + model.safetensors."""
    d = tmp_path_factory.mktemp("hf") / "llama"
    build_ar_model(preset="tiny", seed=5).save_checkpoint(d)
    return d


@pytest.fixture(scope="module")
def reference(llama: Path) -> torch.Tensor:
    return build_ar_model(path=llama).prefill(IDS)


def _variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None, **config: object) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _shard(d: Path, state: dict[str, torch.Tensor], n: int = 2) -> dict[str, str]:
    """Replace model.safetensors by n shards + model.safetensors.index.json (HF's names)."""
    (d / "model.safetensors").unlink()
    keys = sorted(state)
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = keys[i::n]
        save_file({k: state[k] for k in part}, str(d / name))
        weight_map.update({k: name for k in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return weight_map


def test_layouts_of_real_releases_load_the_same_model(llama: Path, reference: torch.Tensor, tmp_path: Path) -> None:
    """Sharded with an index, the weights symlinked from elsewhere (Hugging Face's cache keeps
    them in ../../blobs), the LM head / final norm / RoPE tables / optimizer leftovers beside
    the decoder, a tied-embeddings config: all the same model, bit for bit."""
    state = load_file(str(llama / "model.safetensors"))
    sharded = _variant(llama, tmp_path / "sharded")
    _shard(sharded, state, 3)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    cache = _variant(llama, tmp_path / "snapshot")
    shutil.move(str(cache / "model.safetensors"), str(blobs / "abc123"))
    os.symlink(os.path.relpath(blobs / "abc123", cache), cache / "model.safetensors")
    extras = {
        "lm_head.weight": torch.zeros(4, 4),
        "model.norm.weight": torch.ones(128),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
        "optimizer.state.0.exp_avg": torch.zeros(3),
    }
    extra = _variant(llama, tmp_path / "extra", {**state, **extras}, tie_word_embeddings=True)
    for d in (sharded, cache, extra):
        assert torch.equal(build_ar_model(path=d).prefill(IDS), reference), d.name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_load_as_their_values(llama: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    state = load_file(str(llama / "model.safetensors"))
    half = {k: v.to(dtype) for k, v in state.items()}
    d = _variant(llama, tmp_path / "half", half)
    model = build_ar_model(path=d)  # float32 on the CPU: the stored values, widened
    for name, p in model.named_parameters():
        assert torch.equal(p, half["model." + name].float()), name


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _huge_header(d: Path) -> None:
    data = bytearray((d / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 2**60)
    (d / "model.safetensors").write_bytes(bytes(data))


def _dangling(d: Path) -> None:
    (d / "model.safetensors").unlink()
    os.symlink("../blobs/never-downloaded", d / "model.safetensors")


@pytest.mark.parametrize(
    "breakage, message",
    [
        (_truncate, r"model.safetensors: not a readable safetensors file \(.*incomplete metadata"),
        (_huge_header, r"model.safetensors: not a readable safetensors file \(.*header too large"),
        (_dangling, r"model.safetensors: cannot be read: .*a link to '../blobs/never-downloaded', which is not there"),
    ],
)
def test_an_unreadable_file_is_named(llama: Path, tmp_path: Path, breakage, message: str) -> None:
    d = _variant(llama, tmp_path / "broken")
    breakage(d)
    with pytest.raises(CheckpointError, match=message):
        build_ar_model(path=d)


def test_pickle_weights_are_never_loaded(llama: Path, tmp_path: Path) -> None:
    """A directory with only pytorch_model.bin: refused, unread (unpickling runs code)."""
    d = _variant(llama, tmp_path / "bin")
    (d / "model.safetensors").unlink()
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):  # what an untrusted pickle can do when loaded
            return (os.mkdir, (str(marker),))

    torch.save({"model.embed_tokens.weight": Payload()}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only PyTorch pickle weights \['pytorch_model.bin'\].*never unpickles"):
        build_ar_model(path=d)
    assert not marker.exists()


def test_tensors_of_another_architecture_are_refused(llama: Path, tmp_path: Path) -> None:
    """Decoder tensors the built-in AR does not have would be dropped and the KV silently wrong:
    Qwen3's QK-norm, biases a Llama config does not declare, a layer past num_hidden_layers."""
    state = load_file(str(llama / "model.safetensors"))
    cases = {
        "model.layers.0.self_attn.q_norm.weight": torch.ones(16),
        "model.layers.1.self_attn.k_proj.bias": torch.zeros(64),
        "model.layers.1.mlp.gate_proj.bias": torch.zeros(256),
    }
    for i, (key, tensor) in enumerate(cases.items()):
        d = _variant(llama, tmp_path / f"arch{i}", {**state, key: tensor})
        with pytest.raises(CheckpointError, match=rf"has tensor '{key}' \(model.safetensors\), which the model does not have"):
            build_ar_model(path=d)
    extra = _variant(llama, tmp_path / "extra", {**state, "model.layers.2.self_attn.q_proj.weight": torch.zeros(128, 128)})
    fewer = _variant(llama, tmp_path / "fewer", num_hidden_layers=1)
    for d, held in ((extra, "layers 0..2"), (fewer, "layers 0..1")):
        with pytest.raises(CheckpointError, match=rf"config.json says num_hidden_layers \d, the weights hold {held}"):
            build_ar_model(path=d)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, r"model_type 'qwen3' \['Qwen3ForCausalLM'\]"),
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type 'gemma'"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
        ({"mlp_bias": True}, "mlp_bias true"),
        ({"model_type": "mistral", "sliding_window": 64}, "sliding_window 64"),
    ],
)
def test_a_family_the_built_in_ar_does_not_compute_is_refused(llama: Path, tmp_path: Path, config, message) -> None:
    """Gemma has Llama's tensor names (the files alone would load) but another forward pass."""
    from kvrelay.models.formats import hf_geometry

    d = _variant(llama, tmp_path / "other", **config)
    with pytest.raises(CheckpointError, match=rf"config.json: {message}"):
        build_ar_model(path=d)

    class Model:  # a stage's model entry, as the config check sees it before anything starts
        format, preset, path, dtype, engine = "kvrelay", None, str(d), None, "builtin"

    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        hf_geometry(Model(), on_cpu=True)
    Model.engine = "vllm"  # vLLM serves its own families: not refused here
    assert hf_geometry(Model(), on_cpu=True) is not None


def test_wrong_dtype_shape_prefix_and_config_are_named(llama: Path, tmp_path: Path) -> None:
    state = load_file(str(llama / "model.safetensors"))
    k = "model.layers.0.self_attn.k_proj.weight"
    cases = [
        ({**state, k: state[k][:32]}, {}, rf"{k}: shape \(32, 128\) in model.safetensors, the model expects \(64, 128\)"),
        ({**state, k: state[k].to(torch.int32)}, {}, rf"{k} in model.safetensors: stored as I32; .*floating-point"),
        ({**state, k: state[k].to(torch.float8_e4m3fn)}, {}, rf"{k} in model.safetensors: stored as F8_E4M3"),
        ({"module." + n: t for n, t in state.items()}, {},
         r"bad3: no tensor named model.layers.\* \(the files have 'module.model.layers.0.input_layernorm.weight': saved under the prefix 'module.'"),
        (state, {"intermediate_size": None}, r"config.json: not a Llama/Qwen2 config \(TypeError"),
    ]  # fmt: skip
    for i, (tensors, config, message) in enumerate(cases):
        d = _variant(llama, tmp_path / f"bad{i}", tensors, **config)
        with pytest.raises(CheckpointError, match=message):
            build_ar_model(path=d)
    d = _variant(llama, tmp_path / "nokey")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: no 'intermediate_size'"):
        build_ar_model(path=d)


def test_a_broken_index_or_ambiguous_files_are_refused(llama: Path, tmp_path: Path) -> None:
    """The index may name only files beside it; a tensor in two files, or not where the index
    puts it, cannot be resolved without guessing."""
    state = load_file(str(llama / "model.safetensors"))
    outside = tmp_path / "elsewhere.safetensors"
    save_file(state, str(outside))
    for i, name in enumerate(["../elsewhere.safetensors", str(outside)]):
        d = _variant(llama, tmp_path / f"escape{i}")
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(state, name)}))
        with pytest.raises(CheckpointError, match=rf"shard '{name}' is not a file name in"):
            build_ar_model(path=d)
    d = _variant(llama, tmp_path / "nomap")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match='index.json: no "weight_map"'):
        build_ar_model(path=d)
    d = _variant(llama, tmp_path / "misplaced")
    weight_map = _shard(d, state)
    key = sorted(weight_map)[0]
    other = next(v for v in weight_map.values() if v != weight_map[key])
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, key: other}}))
    with pytest.raises(CheckpointError, match=rf"puts tensor '{key}' in {other}, but it is in model-0000"):
        build_ar_model(path=d)
    d = _variant(llama, tmp_path / "stray")
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(256, 128)}, str(d / "adapter.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' is in both adapter.safetensors and model.safetensors"):
        build_ar_model(path=d)
    d = _variant(llama, tmp_path / "badjson")
    (d / "config.json").write_text("{'not': json}")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        build_ar_model(path=d)


def test_the_dit_format_refuses_other_presets_and_broken_files(tmp_path: Path) -> None:
    """`{preset, path}` DiT checkpoints: a deeper model's extra blocks, an integer tensor or a
    truncated file are refused naming them (before: extra blocks ignored, the rest untold)."""
    from kvrelay.models.dit import DitRunner

    d = tmp_path / "dit"
    DitRunner("tiny", weight_seed=3).save_checkpoint(d)
    state = load_file(str(d / "dit.safetensors"))
    extra = "model.blocks.2.attn.qkv.weight"
    save_file({**state, extra: torch.zeros(2)}, str(d / "dit.safetensors"))
    with pytest.raises(CheckpointError, match=rf"dit.safetensors has tensor '{extra}', which preset 'tiny' does not have"):
        DitRunner("tiny", checkpoint=d)
    key = next(iter(sorted(state)))
    save_file({**state, key: state[key].to(torch.int64)}, str(d / "dit.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{key} in dit.safetensors: stored as I64"):
        DitRunner("tiny", checkpoint=d)
    (d / "dit.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(CheckpointError, match=r"dit.safetensors: not a readable safetensors file"):
        DitRunner("tiny", checkpoint=d)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_hidden_layers": 10**9}, r"config.json says num_hidden_layers 1000000000, the weights hold layers 0..1"),
        ({"vocab_size": 400_000_000}, r"model.embed_tokens.weight: shape \(\d+, 128\) in model.safetensors, the model expects \(400000000, 128\)"),
        ({"intermediate_size": 10**7}, r"model.layers.0.mlp.gate_proj.weight: shape \(256, 128\) .* expects \(10000000, 128\)"),
    ],
)
def test_a_config_that_is_not_the_weights_is_refused_before_allocating(
    llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config, message
) -> None:
    """A config.json of another size than its weights (a typo, another model's config) is named
    from the headers; before, a model of the config's size was allocated first (10^9 layers
    never finished, 200 GB of embeddings ran out of memory without naming the config)."""
    import kvrelay.models.ar as ar

    def never(*args, **kwargs):
        raise AssertionError("the model was allocated before the files were checked")

    d = _variant(llama, tmp_path / "config", **config)
    monkeypatch.setattr(ar, "ArModel", never)
    with pytest.raises(CheckpointError, match=message):
        build_ar_model(path=d)
