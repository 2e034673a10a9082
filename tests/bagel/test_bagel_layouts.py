"""BAGEL-format directories as users bring them: the release's layout in other stored dtypes and
shardings loads; a truncated, corrupt, pickled, ambiguous or mis-keyed one is refused at load,
naming the file and the tensor (the AR and the DiT alike), and the config check names a broken
llm_config.json before any process starts."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay.models.bagel import build_ar
from kvrelay.models.bagel_config import EMA_FILE, INDEX_FILE
from kvrelay.models.bagel_runner import BagelDitRunner
from kvrelay.models.formats import bagel_geometry
from kvrelay.models.loader import CheckpointError

from .tiny import write_tiny_bagel


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bagel(tmp_path_factory.mktemp("bagel") / "BAGEL-tiny")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _both_refuse(d: Path, message: str) -> None:
    """The AR (build_ar) and the DiT (BagelDitRunner) each refuse `d` with `message`."""
    with pytest.raises(CheckpointError, match=message):
        build_ar(d)
    with pytest.raises(CheckpointError, match=message):
        BagelDitRunner(d)


def test_sharded_bf16_release_loads_its_values(tiny_dir: Path, tmp_path: Path) -> None:
    """ema.safetensors re-saved as bf16 shards with an index (an export's layout), the VAE a
    symlink into a cache: AR and DiT hold exactly the stored values."""
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(tiny_dir / EMA_FILE)).items()}
    d = tmp_path / "bf16"
    d.mkdir()
    for name in ("llm_config.json", "tokenizer.json", "kvrelay.json"):
        shutil.copy(tiny_dir / name, d / name)
    os.symlink(tiny_dir / "ae.safetensors", d / "ae.safetensors")
    keys = sorted(state)
    weight_map = {}
    for i in range(2):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in keys[i::2]}, str(d / name))
        weight_map.update(dict.fromkeys(keys[i::2], name))
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ar = build_ar(d, dtype="float32")
    for name, p in ar.named_parameters():
        assert torch.equal(p, state["language_model.model." + name].float()), name
    runner = BagelDitRunner(d)
    key = "language_model.model.layers.1.mlp_moe_gen.down_proj.weight"
    assert torch.equal(runner.model.get_parameter("layers.1.mlp_moe_gen.down_proj.weight"), state[key].float())


def _truncate(d: Path) -> None:
    data = (d / EMA_FILE).read_bytes()
    (d / EMA_FILE).write_bytes(data[: len(data) - 100])


def _huge_header(d: Path) -> None:
    data = bytearray((d / EMA_FILE).read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    (d / EMA_FILE).write_bytes(bytes(data))


def _garbage(d: Path) -> None:
    (d / EMA_FILE).write_bytes(b"<html>404 Not Found</html>" * 10)


@pytest.mark.parametrize("breakage", [_truncate, _huge_header, _garbage])
def test_an_unreadable_weight_file_is_named(tiny_dir: Path, tmp_path: Path, breakage) -> None:
    d = _copy(tiny_dir, tmp_path / "broken")
    breakage(d)
    _both_refuse(d, r"ema.safetensors: not a readable safetensors file \(.*\): a download cut short")


def test_a_truncated_vae_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "ae")
    data = (d / "ae.safetensors").read_bytes()
    (d / "ae.safetensors").write_bytes(data[: len(data) // 3])
    build_ar(d)  # the AR reads no VAE
    with pytest.raises(CheckpointError, match=r"ae.safetensors: not a readable safetensors file"):
        BagelDitRunner(d)


def test_pickle_weights_are_never_loaded(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "bin")
    (d / EMA_FILE).unlink()
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"vae2llm.weight": Payload()}, d / "ema.pt")
    _both_refuse(d, r"only PyTorch pickle weights \['ema.pt'\]: kvrelay loads safetensors only")
    assert not marker.exists()


def test_keys_dtypes_and_duplicates_are_named(tiny_dir: Path, tmp_path: Path) -> None:
    state = load_file(str(tiny_dir / EMA_FILE))
    key = "language_model.model.layers.0.self_attn.k_proj.weight"
    cases = [
        ({key: state[key].to(torch.int8)}, rf"{key} in ema.safetensors: stored as I8"),
        ({"optimizer.state.1.exp_avg_sq": torch.zeros(2)}, r"unexpected tensor 'optimizer.state.1.exp_avg_sq' \(ema.safetensors\)"),
    ]  # fmt: skip
    for i, (edit, message) in enumerate(cases):
        d = _copy(tiny_dir, tmp_path / f"c{i}")
        save_file({**state, **edit}, str(d / EMA_FILE))
        _both_refuse(d, message)
    d = _copy(tiny_dir, tmp_path / "prefix")
    save_file({"module." + k: v for k, v in state.items()}, str(d / EMA_FILE))
    _both_refuse(d, r"no tensor 'vae2llm.weight' \(the files have 'module.vae2llm.weight': saved under the prefix 'module.'")
    # Without ema.safetensors or an index every *.safetensors is read: a second copy of a tensor
    # (a leftover export) is ambiguous, not "the last file wins".
    d = _copy(tiny_dir, tmp_path / "dup")
    (d / EMA_FILE).rename(d / "model.safetensors")
    save_file({key: torch.zeros_like(state[key])}, str(d / "finetune.safetensors"))
    _both_refuse(d, rf"tensor '{key}' is in both finetune.safetensors and model.safetensors")
    d = _copy(tiny_dir, tmp_path / "escape")
    (d / EMA_FILE).unlink()
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(state, str(tiny_dir / EMA_FILE))}))
    _both_refuse(d, r"shard '/.*ema.safetensors' is not a file name in")


def test_broken_json_files_are_named_at_config_check_and_load(tiny_dir: Path, tmp_path: Path) -> None:
    """A key missing from llm_config.json, or a kvrelay.json that is not JSON: the file is named
    by the config check (before: a KeyError traceback from `kvrelay up`) and by the loaders."""

    class Model:
        format, preset, dtype, engine = "bagel", None, None, "builtin"

    d = _copy(tiny_dir, tmp_path / "llm")
    llm = json.loads((d / "llm_config.json").read_text())
    del llm["num_attention_heads"]
    (d / "llm_config.json").write_text(json.dumps(llm))
    Model.path = str(d)
    with pytest.raises(ValueError, match=r"llm_config.json .*no 'num_attention_heads'"):
        bagel_geometry(Model())
    _both_refuse(d, r"llm_config.json: no 'num_attention_heads'")
    d = _copy(tiny_dir, tmp_path / "kv")
    (d / "kvrelay.json").write_text("{dtype: float32}")
    Model.path = str(d)
    with pytest.raises(ValueError, match=r"kvrelay.json: not valid JSON"):
        bagel_geometry(Model())
    _both_refuse(d, r"kvrelay.json: not valid JSON")



@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_hidden_layers": 10**9}, r"llm_config.json says num_hidden_layers 1000000000, the weights hold layers 0..1"),
        ({"hidden_size": 35840}, r"embed_tokens.weight: shape \(18, 64\) in ema.safetensors, llm_config.json says vocab_size x hidden_size = \(18, 35840\)"),
        ({"intermediate_size": 10**7}, r"layers.0.mlp.gate_proj.weight: shape \(96, 64\) in ema.safetensors, the model expects \(10000000, 64\)"),
    ],
)
def test_an_llm_config_that_is_not_the_weights_is_refused_before_allocating(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config, message
) -> None:
    import kvrelay.models.bagel as bagel
    import kvrelay.models.bagel_runner as runner

    for module, name in ((bagel, "BagelAr"), (bagel, "BagelDit"), (runner, "BagelDit")):
        real = getattr(module, name)

        def only_meta(*args, real=real, **kwargs):
            assert str(kwargs.get("device")) == "meta", "the model was allocated before the files were checked"
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, only_meta)
    d = _copy(tiny_dir, tmp_path / "cfg")
    llm = json.loads((d / "llm_config.json").read_text())
    llm.update(config)
    (d / "llm_config.json").write_text(json.dumps(llm))
    _both_refuse(d, message)


@pytest.mark.parametrize(
    ("tokenizer", "why"),
    [("[]", r"AttributeError"), ('{"added_tokens": [{"id": 1}]}', r"no 'content'")],
)
def test_a_tokenizer_json_of_another_shape_is_named(tmp_path: Path, tokenizer: str, why: str) -> None:
    """The DiT service reads the special tokens before its ranks start (load_bagel_config): a
    tokenizer.json that is JSON but not a tokenizer's ended its start with a bare AttributeError
    or KeyError naming no file."""
    from kvrelay.models.bagel_config import load_bagel_config
    from kvrelay.models.formats import DEMO_DIR

    d = _copy(DEMO_DIR, tmp_path / "demo")
    (d / "tokenizer.json").write_text(tokenizer)
    named = rf"demo/tokenizer.json: not a Hugging Face tokenizer.json \({why}"
    with pytest.raises(CheckpointError, match=named):
        load_bagel_config(d)
