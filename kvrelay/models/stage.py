"""A stage's full ModelPreset, in the service before it spawns its ranks.

A named preset's comes from kvrelay.models.presets, a BAGEL-format directory's from its
llm_config.json, tokenizer.json and safetensors headers (kvrelay.models.bagel_config): neither
imports torch, which only the ranks do. Here and not in kvrelay.models.formats, which config
validation (the broker too) imports: the broker reads no safetensors header.
"""

from __future__ import annotations

from typing import Any

from kvrelay.models.formats import BAGEL_FORMATS, model_dir
from kvrelay.models.presets import ModelPreset, get_preset


def stage_preset(model: Any) -> ModelPreset:
    """The ModelPreset of a stage's ModelConfig: the named preset, or a BAGEL-format directory's
    shape (llm_config.json, safetensors headers). No torch: the DiT service asks before it spawns
    its ranks, and a torch import there delayed every start (and restart) by seconds."""
    if model.format in BAGEL_FORMATS:
        from kvrelay.models.bagel_config import load_bagel_config

        directory = model_dir(model)
        assert directory is not None
        return load_bagel_config(directory, dtype=model.dtype).preset(model.format)
    return get_preset(model.preset)
