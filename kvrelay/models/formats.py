"""Which model a stage's `model:` entry names, whatever its format.

Owns the small dispatch every process needs before it builds anything: the checkpoint
directory of a format (the bundled demo's when `format: demo` gives no path) and the KV
geometry it implies, from JSON files only (no torch: config validation runs in the broker
too). The full ModelPreset of a BAGEL directory is kvrelay.models.bagel.stage_preset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The demo model trained by scripts/train_demo.py, committed beside this module.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
BAGEL_FORMATS = ("bagel", "demo")


def model_dir(model: Any) -> str | None:
    """The weights directory of a ModelConfig (None: random preset weights)."""
    if model.format == "demo" and not model.path:
        return str(DEMO_DIR)
    return str(model.path) if model.path else None


def bagel_geometry(model: Any) -> tuple[int, int, int, str] | None:
    """(num_layers, num_kv_heads, head_dim, dtype) of a BAGEL-format model from its JSON files
    only (no torch: config validation runs in the broker too); None when the directory is not on
    this machine. Raises ValueError for a directory that is there but unreadable."""
    directory = model_dir(model)
    if directory is None or not Path(directory).is_dir():
        return None
    llm_path = Path(directory) / "llm_config.json"
    if not llm_path.is_file():
        raise ValueError(f"{directory} has no llm_config.json: not a BAGEL checkpoint directory")
    llm = json.loads(llm_path.read_text())
    extra_path = Path(directory) / "kvrelay.json"
    extra = json.loads(extra_path.read_text()) if extra_path.is_file() else {}
    heads = int(llm["num_attention_heads"])
    head_dim = int(llm.get("head_dim") or int(llm["hidden_size"]) // heads)
    dtype = model.dtype or extra.get("dtype", "bfloat16")
    return int(llm["num_hidden_layers"]), int(llm.get("num_key_value_heads", heads)), head_dim, str(dtype)
