"""The built-in AR against Hugging Face transformers' own Llama and Qwen2 on the same checkpoint:
the K (after RoPE) and V of every layer must match the reference implementation's KV cache.
Needs `transformers` (not a kvrelay dependency): skipped where it is not installed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.models.ar import ArModel
from kvrelay.models.presets import get_preset

transformers = pytest.importorskip("transformers")


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache[layer][0], cache[layer][1]


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
def test_prefill_kv_matches_transformers(tmp_path, qkv_bias):
    cfg = dataclasses.replace(get_preset("tiny").ar, qkv_bias=qkv_bias, rope_theta=50000.0)
    ours = ArModel(cfg).init_random(seed=13)
    ours.save_checkpoint(tmp_path)
    auto = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    auto.eval()
    ids = torch.tensor([[256, *b"a small red boat on a calm lake"]])
    with torch.no_grad():
        cache = auto(input_ids=ids, use_cache=True).past_key_values
    kv = ours.prefill(ids[0])
    for layer in range(cfg.num_layers):
        k_ref, v_ref = _layer_kv(cache, layer)
        torch.testing.assert_close(kv[layer, 0], k_ref[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv[layer, 1], v_ref[0], rtol=1e-4, atol=1e-4)
