"""A stage's full ModelPreset, in the service before it spawns its ranks.

A named preset's comes from kvrelay.models.presets without torch; only a BAGEL-format directory's
is read through kvrelay.models.bagel (its config and safetensors headers), which imports torch.
Here and not in kvrelay.models.formats, which config validation (the broker too) imports: the
broker never imports torch, not even behind a function.
"""

from __future__ import annotations

from typing import Any

from kvrelay.models.formats import BAGEL_FORMATS, model_dir
from kvrelay.models.presets import ModelPreset, get_preset


def stage_preset(model: Any) -> ModelPreset:
    """The ModelPreset of a stage's ModelConfig: the named preset, or a BAGEL-format directory's
    shape (llm_config.json, safetensors headers). Only the latter imports torch: the DiT service
    asks before it spawns its ranks, and a named preset's start waited a torch import there."""
    if model.format in BAGEL_FORMATS:
        from kvrelay.models.bagel import load_bagel_config

        directory = model_dir(model)
        assert directory is not None
        return load_bagel_config(directory, dtype=model.dtype).preset(model.format)
    return get_preset(model.preset)
