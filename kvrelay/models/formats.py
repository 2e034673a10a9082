"""Which model a stage's `model:` entry names, whatever its format.

Owns the small dispatch every service needs before it builds anything: the checkpoint
directory of a format (the bundled demo's when `format: demo` gives no path) and the
ModelPreset (KV geometry and stage shapes) it implies. Reading a BAGEL directory's shape opens
only JSON files and safetensors headers, so the service's main process can call it cheaply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrelay.models.presets import ModelPreset, get_preset

# The demo model trained by scripts/train_demo.py, committed beside this module.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
BAGEL_FORMATS = ("bagel", "demo")


def model_dir(model: Any) -> str | None:
    """The weights directory of a ModelConfig (None: random preset weights)."""
    if model.format == "demo" and not model.path:
        return str(DEMO_DIR)
    return str(model.path) if model.path else None


def model_preset(model: Any) -> ModelPreset:
    """The preset of a ModelConfig: the named one, or the shape of a BAGEL-format directory."""
    if model.format in BAGEL_FORMATS:
        from kvrelay.models.bagel import load_bagel_config

        directory = model_dir(model)
        assert directory is not None
        return load_bagel_config(directory, dtype=model.dtype).preset(model.format)
    return get_preset(model.preset)
