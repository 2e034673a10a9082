"""Safetensors checkpoints: write, read back (whole and sharded), Llama names and config.json."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kvrelay.models.ar import ArModel, build_ar_model
from kvrelay.models.checkpoint import CheckpointError, ar_config_from_hf, ar_config_to_hf
from kvrelay.models.loader import (
    COLUMN,
    ROW,
    TensorSpec,
    llama_key_map,
    read_checkpoint,
    write_checkpoint,
)
from kvrelay.models.parallel import TpGroup
from kvrelay.models.presets import get_preset


def test_checkpoint_written_and_read_back_gives_identical_outputs(tmp_path):
    model = build_ar_model(preset="tiny", seed=21)
    model.save_checkpoint(tmp_path / "ckpt")
    loaded = build_ar_model(path=tmp_path / "ckpt")
    assert loaded.config == model.config
    ids = list(range(40, 90))
    assert torch.equal(loaded.prefill(ids), model.prefill(ids))
    # A different seed really is a different model, so the equality above means something.
    assert not torch.equal(build_ar_model(preset="tiny", seed=22).prefill(ids), model.prefill(ids))


def test_checkpoint_uses_llama_names_and_config(tmp_path):
    build_ar_model(preset="tiny", seed=1).save_checkpoint(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    assert "model.layers.1.self_attn.q_proj.weight" in keys
    assert "model.layers.0.mlp.down_proj.weight" in keys
    assert len(keys) == len(llama_key_map(2))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert ar_config_from_hf(config) == get_preset("tiny").ar


def test_sharded_read_returns_each_ranks_slice(tmp_path):
    full = {"a": torch.arange(24.0).view(4, 6), "b": torch.arange(24.0).view(4, 6), "c": torch.ones(3)}
    key_map = (TensorSpec("a", "x.a", COLUMN), TensorSpec("b", "x.b", ROW), TensorSpec("c", "x.c"))
    write_checkpoint(tmp_path, full, key_map)
    for rank in range(2):
        part = read_checkpoint(tmp_path, key_map, TpGroup(rank, 2))
        assert torch.equal(part["a"], full["a"][2 * rank : 2 * rank + 2])
        assert torch.equal(part["b"], full["b"][:, 3 * rank : 3 * rank + 3])
        assert torch.equal(part["c"], full["c"])
    with pytest.raises(CheckpointError, match="does not split"):
        read_checkpoint(tmp_path, key_map, TpGroup(0, 4))


def test_tp_shards_loaded_from_a_checkpoint_equal_random_init_shards(tmp_path):
    build_ar_model(preset="tiny", seed=5).save_checkpoint(tmp_path)
    cfg = get_preset("tiny").ar
    for rank in range(2):
        from_seed = ArModel(cfg, TpGroup(rank, 2)).init_random(5)
        from_file = ArModel(cfg, TpGroup(rank, 2)).load_checkpoint(tmp_path)
        for (name, a), (_, b) in zip(from_seed.named_parameters(), from_file.named_parameters(), strict=True):
            assert torch.equal(a, b), name


def test_missing_tensor_and_bad_shape_are_named(tmp_path):
    model = build_ar_model(preset="tiny", seed=0)
    tensors = {n: p for n, p in model.named_parameters()}
    del tensors["layers.1.mlp.up_proj.weight"]
    key_map = tuple(s for s in model.key_map if s.model_key != "layers.1.mlp.up_proj.weight")
    write_checkpoint(tmp_path, tensors, key_map)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        ArModel(model.config).load_checkpoint(tmp_path)


def test_qwen2_config_maps_biases():
    cfg = ar_config_from_hf(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 3584,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "intermediate_size": 18944,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
        }
    )
    assert (cfg.head_dim, cfg.qkv_bias, cfg.num_kv_heads) == (128, True, 4)
    assert ar_config_from_hf(ar_config_to_hf(cfg)) == cfg
    assert any(s.file_key == "model.layers.0.self_attn.k_proj.bias" for s in llama_key_map(1, qkv_bias=True))


def test_rope_settings_of_both_config_generations():
    base = ar_config_to_hf(get_preset("tiny").ar)
    del base["rope_theta"]
    newer = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert ar_config_from_hf(newer).rope_theta == 500000.0
    scaled = {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(CheckpointError, match="llama3"):
        ar_config_from_hf(scaled)


def test_a_model_path_that_is_not_there_says_so_not_which_file_it_lacks(tmp_path):
    """A typo in `model.path` reads "does not exist", on the Llama, DiT and BAGEL loaders alike,
    not "has no config.json" (which sends a user looking for a file)."""
    from kvrelay.models.bagel_config import load_bagel_config, weight_files
    from kvrelay.models.checkpoint import checkpoint_files, read_hf_config
    from kvrelay.models.dit import DitRunner

    missing = tmp_path / "no-such-model"
    for load in (read_hf_config, checkpoint_files, load_bagel_config, weight_files):
        with pytest.raises(CheckpointError, match=r"model path '.*no-such-model' does not exist"):
            load(missing)
    with pytest.raises(CheckpointError, match="does not exist"):
        DitRunner("tiny", checkpoint=missing)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match="is not a directory"):
        read_hf_config(tmp_path / "a-file")


def test_a_sharded_index_naming_an_absent_shard_names_it(tmp_path):
    """`model.safetensors.index.json` lists a shard that was not downloaded: one error naming
    it (Llama and BAGEL layouts), not a bare "No such file" from deep inside safetensors."""
    from kvrelay.models.bagel_config import INDEX_FILE, weight_files
    from kvrelay.models.checkpoint import checkpoint_files

    build_ar_model(preset="tiny", seed=3).save_checkpoint(tmp_path)
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}  # fmt: skip
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for files in (checkpoint_files, weight_files):
        with pytest.raises(CheckpointError, match=r"names 1 of 2 shard\(s\).*\['model-00002-of-00002.safetensors'\]"):
            files(tmp_path)
