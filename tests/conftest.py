"""Test-wide settings for a 2-core CI machine: torch threads, a hypothesis CI profile, helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Each pytest process (and every worker it spawns, through the environment) takes its share of
# the cores; workers spawned by the harness set their own share again.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("KVRELAY_LOG_FORMAT", "json")

try:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
except ImportError:  # pragma: no cover - the client-only install has no torch
    pass

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def python_exe() -> str:
    return sys.executable


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU results live in benchmarks/)")
    for item in items:
        # The marker, not item.keywords: keywords also hold directory names (a checkout named gpu/).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
