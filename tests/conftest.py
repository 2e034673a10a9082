"""Test-wide settings for a 2-core CI machine: torch threads, a hypothesis CI profile, helpers."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Each pytest process (and every worker it spawns, through the environment) takes its share of
# the cores; workers spawned by the harness set their own share again.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("KVRELAY_LOG_FORMAT", "json")

# No logger of this process caches its processors: structlog.testing.capture_logs swaps them,
# and a module logger an earlier test had used (cached under that test's configure_logging) was
# invisible to it: whole test modules saw no event in a full run and passed alone.
import kvrelay.logging  # noqa: E402

kvrelay.logging.CACHE_LOGGERS = False

# CPython 3.11.7: ast.parse keeps one recursion counter per interpreter. A garbage collection
# inside it (it allocates a node object per AST node) may run a finalizer that raises (grpc's
# InterceptedCall.__del__ on a closed channel), and the unraisable hook formats that traceback,
# which parses source again (3.11's caret anchors): the outer parse then fails with "SystemError:
# AST constructor recursion depth mismatch" and pytest, formatting a failure, crashed the whole
# run (INTERNALERROR, every later test unrun). No collection runs inside a parse here.
import ast  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402

_ast_parse = ast.parse


@functools.wraps(_ast_parse)
def _parse_without_gc(*args, **kwargs):  # type: ignore[no-untyped-def]
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _ast_parse(*args, **kwargs)
    finally:
        if enabled:
            gc.enable()


ast.parse = _parse_without_gc

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


# Mooncake receivers (DiT ranks, test receivers) draw their RPC and data ports at random from
# MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (15000-17000). A long-lived sender engine (this pytest
# process's own, which writes to receivers of many tests) cannot write to a receiver on a port
# that an earlier, dead one had; `MooncakeEndpoint` then writes through a fresh engine, but
# bounded (4 at once, then one per 10 s; docs/transfer.md, "Peers that restart on a dead one's
# port"; seen twice in one CI run before that). Each test's processes get their own window of the range, in order, so
# no receiver of a run takes a port an earlier one of the run had.
#
# And the MC_* variables a test sets (in its body or its function-scoped fixtures) do not reach
# the next test: each is put back as it was before the test. Every process a test starts reads
# the Mooncake engine's settings from the environment it gets from this one, and an endpoint made
# in this process (kvrelay/transfer/mooncake.py) sets some in it. One it used to set
# (MC_DISABLE_METACACHE=1) turned the descriptor cache off in the nodes of every later test of a
# full run, never in a file run alone: to a stopped receiver a batch then blocked ~60 s instead of
# MC_TRANSFER_TIMEOUT (tests/e2e/test_in_doubt_write.py).
_MC_PORT_RANGE = (15000, 32000)  # below Linux's ephemeral ports (32768-60999)
_MC_PORT_WINDOW = 40
_mc_windows = itertools.count()


@pytest.fixture(autouse=True)
def _own_mooncake_ports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    before = {k: v for k, v in os.environ.items() if k.startswith("MC_")}
    if "MC_MIN_RPC_PORT" not in os.environ:  # else the caller chose a range: leave it
        span = _MC_PORT_RANGE[1] - _MC_PORT_RANGE[0]
        lo = _MC_PORT_RANGE[0] + (next(_mc_windows) * _MC_PORT_WINDOW) % span
        monkeypatch.setenv("MC_MIN_RPC_PORT", str(lo))
        monkeypatch.setenv("MC_MAX_RPC_PORT", str(lo + _MC_PORT_WINDOW - 1))
    yield
    for key in [k for k in os.environ if k.startswith("MC_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)


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
