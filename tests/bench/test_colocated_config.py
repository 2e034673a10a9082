"""The colocated baseline of `kvrelay bench` runs the DiT the config's DiT stage describes: a fair
comparison with a quantized DiT stage (`model.quantization: fp8`) needs an FP8 baseline, also when
`--preset` replaces the stages' presets. On the CPU, with the H200 configs' devices moved there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvrelay.config import load_config
from kvrelay.models.fp8 import FP8_DTYPE
from kvrelay.node.bench import ColocatedUnderTest, Workload, scenario_config


def _on_cpu(repo_root: Path, name: str) -> dict[str, Any]:
    data = load_config(repo_root / "configs" / name).model_dump(mode="json", exclude_none=True)
    for stage in data["stages"]:
        stage["devices"] = "cpu"
    return data


def _fp8_buffers(module: Any) -> int:
    return sum(1 for b in module.buffers() if b.dtype == FP8_DTYPE)


@pytest.mark.parametrize(("name", "quantization"), [("h200-1gpu.yaml", None), ("h200-1gpu-fp8.yaml", "fp8")])
def test_colocated_baseline_takes_the_dit_stages_quantization(
    repo_root: Path, name: str, quantization: str | None
) -> None:
    # `--preset tiny --max-num-seqs 2` over the shipped config: the preset changes, the rest stays.
    data = scenario_config(_on_cpu(repo_root, name), "tiny", max_num_seqs=2)
    ar_model, dit_model = data["stages"][0]["model"], data["stages"][1]["model"]
    assert ar_model["preset"] == dit_model["preset"] == "tiny"
    assert dit_model.get("quantization") == quantization and "quantization" not in ar_model
    node = ColocatedUnderTest.for_config(data, "tiny")
    try:
        pipeline = node.pipeline
        assert pipeline.max_batch == 2 and str(pipeline.pool.device) == "cpu"
        assert pipeline.dit.quantization == quantization
        # per block: fused qkv, o_proj, fused gate/up, down_proj; the AR is never quantized
        assert _fp8_buffers(pipeline.dit.model) == (4 * pipeline.preset.dit.num_layers if quantization else 0)
        assert _fp8_buffers(pipeline.ar) == 0
        prompts = [{"prompt": "a red circle", "negative_prompt": "blurry", "seed": 3}]
        records, _, _ = node.run(Workload("seed", "tiny", 64, 64, 1, 2.0, prompts), 2, 2, run_idx=0)
        assert [r.ok for r in records] == [True, True], [r.error for r in records]
    finally:
        node.stop()
