"""An AR or DiT service process of a BAGEL-format model (the default demo of `kvrelay up`, a
BAGEL directory) imports no torch: only its ranks do.

A service reads what it needs of the checkpoint before it spawns its ranks (the DiT its KV
geometry and largest image, the AR its tokenizer's special tokens) from JSON and safetensors
headers. Before, it read them through kvrelay.models.bagel (the modules and the strict load),
which imports torch: seconds and hundreds of MB in every service start and restart, before ranks
that import torch again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from kvrelay.config import DEFAULT_CONFIG

REPO = Path(__file__).resolve().parents[2]

# What each service does with its model before it serves (kvrelay/ar_service/main.py,
# kvrelay/dit_service/main.py), for each stage of the config in argv[1].
SERVICE_READS = """
import sys
from kvrelay.ar_service.main import _rank_spec
from kvrelay.config import load_config
from kvrelay.dit_service.main import model_max_image_side
from kvrelay.dit_service.memory import dit_geometry
from kvrelay.models.stage import stage_preset
from kvrelay.models.tokenizer import load_tokenizer

cfg = load_config(sys.argv[1])
ar, dit = cfg.ar_stage, cfg.dit_stage
assert _rank_spec(ar).path is not None
assert load_tokenizer(ar.model.tokenizer, model=ar.model).encode("a red circle")
preset = stage_preset(dit.model)
assert dit_geometry(preset, dit.page_size, dit.model.dtype).num_layers == preset.num_layers
assert model_max_image_side(dit.model) > 0
assert "torch" not in sys.modules, "the service imported torch before spawning its ranks"
"""


def _bagel_config(tmp: Path, model: dict[str, str]) -> Path:
    """configs/single-node.yaml (the default of `kvrelay up`) on free ports, with `model` and the
    page and staging memory of tests/configs/test-fast.yaml (CI's memory; no request is made)."""
    data = yaml.safe_load((REPO / DEFAULT_CONFIG).read_text())
    data["broker"].update(port=0, metrics_port=0, journal_path=str(tmp / "journal.sqlite"))
    for stage, memory in zip(data["stages"], (16 << 20, 8 << 20), strict=True):
        stage.update(port=0, metrics_port=0, model=model, kv_cache_memory_bytes=memory)
    path = tmp / "node.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_services_read_a_bagel_directory_and_the_demo_without_torch(tmp_path: Path) -> None:
    """The demo (kvrelay up's default) and a BAGEL directory as tests/bagel write it: geometry,
    largest image, rank spec and tokenizer, all without torch."""
    from tests.bagel.tiny import write_tiny_bagel

    bagel = write_tiny_bagel(tmp_path / "bagel")
    for name, model in (("demo", {"format": "demo"}), ("bagel", {"format": "bagel", "path": str(bagel)})):
        (tmp_path / f"node-{name}").mkdir()
        config = _bagel_config(tmp_path / f"node-{name}", model)
        done = subprocess.run(
            [sys.executable, "-c", SERVICE_READS, str(config)], capture_output=True, text=True
        )
        assert done.returncode == 0, f"{name}: {done.stderr}"


def _loads_torch(proc: psutil.Process) -> bool:
    """Whether libtorch is mapped in the process (what `import torch` loads)."""
    return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()


@pytest.mark.slow
def test_kvrelay_up_default_services_load_no_torch_and_their_ranks_do(tmp_path: Path) -> None:
    """`kvrelay up`'s default node (the demo model): once SERVING, neither the AR nor the DiT
    service process has libtorch mapped, and a rank of each has."""
    from kvrelay.node.supervisor import start_node

    config = _bagel_config(tmp_path, {"format": "demo"})
    with start_node(config, log_dir=tmp_path / "logs", cwd=tmp_path) as node:
        for name in ("ar-0", "dit-0"):
            pid = node.process(name).pid
            assert pid is not None
            service = psutil.Process(pid)
            assert not _loads_torch(service), f"the {name} service process imported torch"
            ranks = service.children()
            assert any(_loads_torch(rank) for rank in ranks), f"no rank of {name} loaded torch: {ranks}"


# A GPU host's driver, faked: what a GPU config's service checks of its devices before its ranks.
GPU_CHECK = """
import sys
import kvrelay.worker as worker

worker._driver_device_count = lambda: 2
worker.check_devices(["cuda:0", "cuda:1", "cpu"], "stages[1] (dit-0) devices")
try:
    worker.check_devices(["cuda:1", "cuda:2"], "stages[0] (ar-0) devices")
    raise AssertionError("cuda:2 of 2 devices passed")
except worker.DeviceUnavailable as err:
    assert str(err) == "stages[0] (ar-0) devices: cuda:2 configured, but this host has 2 visible CUDA device(s)", err
assert "torch" not in sys.modules, "checking the devices imported torch"
"""


def test_a_gpu_service_checks_its_devices_without_torch() -> None:
    """Every GPU config (configs/h200-1gpu.yaml, debug-4gpu, reference-8gpu, compose-node) has
    each service check its `cuda:N` devices before it spawns its ranks: through torch, that was a
    torch import (and its CUDA libraries) in the service. The driver's count answers instead."""
    done = subprocess.run([sys.executable, "-c", GPU_CHECK], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
