"""DiT weights from a local safetensors directory: what is saved is what generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.models.dit import DIT_CHECKPOINT_FILE, DitRunner, random_prefix
from kvrelay.models.loader import CheckpointError


def _image(runner: DitRunner) -> torch.Tensor:
    rows = [random_prefix(runner.preset, 7, 1), random_prefix(runner.preset, 3, 2)]
    return runner.generate(rows, width=64, height=64, steps=2, guidance_scale=2.0, seed=3)


def test_saved_weights_load_into_a_differently_seeded_runner(tmp_path: Path) -> None:
    source = DitRunner("tiny", weight_seed=5)
    source.save_checkpoint(tmp_path)
    loaded = DitRunner("tiny", weight_seed=0, checkpoint=tmp_path)
    assert torch.equal(_image(loaded), _image(source))
    assert not torch.equal(_image(DitRunner("tiny", weight_seed=0)), _image(source))


def test_missing_or_misshapen_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    with pytest.raises(CheckpointError, match=DIT_CHECKPOINT_FILE):
        DitRunner("tiny", checkpoint=tmp_path)
    DitRunner("tiny", weight_seed=1).save_checkpoint(tmp_path)
    tensors = load_file(str(tmp_path / DIT_CHECKPOINT_FILE))
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(tmp_path / DIT_CHECKPOINT_FILE))
    with pytest.raises(CheckpointError, match=dropped.replace(".", r"\.")):
        DitRunner("tiny", checkpoint=tmp_path)
    # A checkpoint of another shape (the `small` preset) does not load into `tiny`.
    DitRunner("small", weight_seed=1).save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="shape|weight"):
        DitRunner("tiny", checkpoint=tmp_path)
