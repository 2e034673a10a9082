"""From the DiT stage of a config to the rank's model: `DitRankSpec.for_stage` (what `kvrelay dit`
starts its ranks with) carries the stage's model settings, and a rank built from it runs the DiT
they describe; here `model.quantization: fp8` (a preset's DiT, and the demo's BAGEL-format one), on
the CPU (torch's reference FP8 GEMM), against a local runner of the same settings."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrelay.config import parse_config
from kvrelay.dit_service.engine import DitRankHandler, DitRankSpec, RunDenoise, control_bytes
from kvrelay.dit_service.memory import HostPool, ReplicaMemory, dit_geometry
from kvrelay.models.bagel import stage_preset
from kvrelay.models.bagel_runner import BagelDitRunner
from kvrelay.models.dit import DitRunner, random_prefix
from kvrelay.models.formats import DEMO_DIR, model_dir
from kvrelay.models.fp8 import FP8_DTYPE
from kvrelay.models.paged_attention import write_prefix
from kvrelay.models.parallel import TpGroup
from kvrelay.models.presets import get_preset
from kvrelay.transfer.layout import PageLayout
from kvrelay.transfer.planner import RowSpec
from kvrelay.worker import RankContext


def _config(repo_root: Path, dit_model: dict[str, Any]) -> dict[str, Any]:
    data = yaml.safe_load((repo_root / "tests" / "configs" / "test-fast.yaml").read_text())
    data = copy.deepcopy(data)
    data["stages"][1]["model"] = dit_model
    return data


def _spec(data: dict[str, Any], memory: ReplicaMemory, control: HostPool) -> DitRankSpec:
    stage = parse_config(data).dit_stage
    assert stage.model.preset is not None
    return DitRankSpec.for_stage(
        stage, preset=stage.model.preset, checkpoint=None, num_pages=memory.num_pages,
        pools=tuple(memory.specs()), control=control.spec, slots=1,
    )


def test_spec_for_stage_carries_the_model_and_layout(repo_root: Path) -> None:
    data = _config(repo_root, {"preset": "tiny", "weight_seed": 3, "dtype": "float32", "quantization": "fp8"})
    data["stages"][1].update(tensor_parallel_size=2, page_size=32)
    stage = parse_config(data).dit_stage
    control = HostPool.create(-1, 64, "test-spec-fields-control")
    try:
        spec = DitRankSpec.for_stage(
            stage, preset="tiny", checkpoint=None, num_pages=7, pools=(), control=control.spec, slots=2
        )
        assert (spec.preset, spec.weight_seed, spec.dtype, spec.quantization) == ("tiny", 3, "float32", "fp8")
        assert (spec.tp, spec.sp, spec.cfg_parallel, spec.page_size, spec.num_pages, spec.slots) == (2, 1, 1, 32, 7, 2)
        assert (spec.model_format, spec.transport) == ("kvrelay", stage.transport)
        del data["stages"][1]["model"]["quantization"]
        plain = DitRankSpec.for_stage(
            parse_config(data).dit_stage, preset="tiny", checkpoint=None, num_pages=7, pools=(), control=control.spec,
            slots=2,
        )
        assert plain.quantization is None and plain == DitRankSpec(**{**_fields(spec), "quantization": None})
    finally:
        control.close()


def _fields(spec: DitRankSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in DitRankSpec.__dataclass_fields__}


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_rank_runs_the_dit_the_stage_describes(repo_root: Path, quantization: str | None) -> None:
    preset = get_preset("tiny")
    model: dict[str, Any] = {"preset": "tiny"}
    if quantization is not None:
        model["quantization"] = quantization
    geometry = dit_geometry(preset, 16)
    memory = ReplicaMemory(geometry, 1, 1 << 20, tag=f"test-spec-{quantization}")
    control = HostPool.create(-1, control_bytes(1), f"test-spec-{quantization}-control")
    handler = None
    try:
        spec = _spec(_config(repo_root, model), memory, control)
        assert spec.quantization == quantization
        handler = DitRankHandler(RankContext(0, 1, "cpu", "gloo", 1, TpGroup.single()), spec)
        runner = handler.runner
        assert runner.quantization == quantization
        fp8 = [name for name, b in runner.model.named_buffers() if b.dtype == FP8_DTYPE]
        # per block: fused qkv, o_proj, fused gate/up, down_proj
        assert len(fp8) == (4 * preset.dit.num_layers if quantization else 0), fp8

        rows = [RowSpec(0, 21, (5, 2)), RowSpec(1, 6, (9,))]
        prefixes = [random_prefix(preset, r.num_tokens, seed=60 + r.row) for r in rows]
        layout = PageLayout(geometry, 1, 0)
        host = HostPool.attach(memory.specs()[0]).tensor()
        for r, p in zip(rows, prefixes, strict=True):
            write_prefix(host, layout, r.page_ids, p)  # what a transfer leaves in the pool
        result = handler.handle(RunDenoise(0, 1, tuple(rows), 64, 64, 2, 2.0, 5))
        assert not result.cancelled and result.steps_done == 2 and result.pixels is not None
        kwargs: dict[str, Any] = dict(width=64, height=64, steps=2, guidance_scale=2.0, seed=5)
        same = DitRunner("tiny", quantization=quantization).generate(prefixes, **kwargs).numpy()
        other = DitRunner("tiny", quantization=None if quantization else "fp8").generate(prefixes, **kwargs).numpy()
        assert (result.pixels == same).all()
        assert not (result.pixels == other).all()  # the two models really differ at this size
    finally:
        if handler is not None:
            handler.close()
        memory.close()
        control.close()


def test_a_demo_rank_runs_its_generation_expert_in_fp8(repo_root: Path) -> None:
    """`format: demo` (a BAGEL-format DiT) with `quantization: fp8`: the rank's BagelDitRunner
    quantizes the generation expert and computes what a local fp8 runner does."""
    data = _config(repo_root, {"format": "demo", "quantization": "fp8"})
    data["stages"][0]["model"] = {"format": "demo"}
    stage = parse_config(data).dit_stage
    preset = stage_preset(stage.model)
    geometry = dit_geometry(preset, 16, stage.model.dtype)
    memory = ReplicaMemory(geometry, 1, 1 << 20, tag="test-spec-demo-fp8")
    control = HostPool.create(-1, control_bytes(1), "test-spec-demo-fp8-control")
    handler = None
    try:
        spec = DitRankSpec.for_stage(
            stage, preset=preset.name, checkpoint=model_dir(stage.model), num_pages=memory.num_pages,
            pools=tuple(memory.specs()), control=control.spec, slots=1,
        )
        assert (spec.model_format, spec.quantization) == ("demo", "fp8")
        handler = DitRankHandler(RankContext(0, 1, "cpu", "gloo", 1, TpGroup.single()), spec)
        runner = handler.runner
        assert isinstance(runner, BagelDitRunner) and runner.quantization == "fp8"
        fp8 = [name for name, b in runner.model.named_buffers() if b.dtype == FP8_DTYPE]
        # per layer: the generation expert's q, k, v, o, fused gate/up and down
        assert len(fp8) == 6 * preset.num_layers and all("_moe_gen" in name for name in fp8), fp8

        rows = [RowSpec(0, 21, (5, 2)), RowSpec(1, 6, (9,))]
        prefixes = [random_prefix(preset, r.num_tokens, seed=70 + r.row) for r in rows]
        layout = PageLayout(geometry, 1, 0)
        host = HostPool.attach(memory.specs()[0]).tensor()
        for r, p in zip(rows, prefixes, strict=True):
            write_prefix(host, layout, r.page_ids, p)
        result = handler.handle(RunDenoise(0, 1, tuple(rows), 256, 256, 2, 2.0, 5))
        assert not result.cancelled and result.steps_done == 2 and result.pixels is not None
        kwargs: dict[str, Any] = dict(width=256, height=256, steps=2, guidance_scale=2.0, seed=5)
        same = BagelDitRunner(DEMO_DIR, quantization="fp8").generate(prefixes, **kwargs).numpy()
        plain = BagelDitRunner(DEMO_DIR).generate(prefixes, **kwargs).numpy()
        assert (result.pixels == same).all()
        assert not (result.pixels == plain).all()  # the FP8 path really ran
    finally:
        if handler is not None:
            handler.close()
        memory.close()
        control.close()


def test_the_dit_registers_its_models_largest_image_side() -> None:
    """What `kvrelay dit` registers as ReplicaInfo.max_image_side (the broker refuses a larger
    image at admission): the demo's BAGEL-format position table covers 16 latent patches of 64
    pixels per side; a preset's sin-cos positions have no limit of their own (0)."""
    from kvrelay.dit_service.main import model_max_image_side

    repo = Path(__file__).resolve().parents[2]
    cfg = parse_config(yaml.safe_load((repo / "configs/single-node.yaml").read_text()))
    assert model_max_image_side(cfg.dit_stage.model) == 1024
    preset = cfg.dit_stage.model.model_copy(update={"format": "kvrelay", "preset": "tiny"})
    assert model_max_image_side(preset) == 0
