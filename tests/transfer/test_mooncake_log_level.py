"""Mooncake's INFO lines stay off a console unless MC_LOG_LEVEL asks for them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mooncake.engine")

# The services' way in (the transport factory) and a direct endpoint.
_STARTS = {
    "factory": "from kvrelay.transfer.transport import make_receiver; make_receiver('mooncake')",
    "endpoint": "from kvrelay.transfer.mooncake import endpoint; endpoint()",
}
_GLOG = re.compile(r"^([IWEF])\d{4} ", re.MULTILINE)


def _severities(start: str, extra_env: dict[str, str]) -> set[str]:
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    env.update(extra_env)
    code = f"{start}; print('started')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr[-2000:]
    return set(_GLOG.findall(proc.stderr))


@pytest.mark.parametrize("way", sorted(_STARTS))
def test_engine_start_prints_no_info_lines_by_default(way: str) -> None:
    seen = _severities(_STARTS[way], {})
    assert "I" not in seen
    assert "W" in seen  # warnings still print (this host has no RDMA device)


def test_an_explicit_mc_log_level_wins() -> None:
    assert "I" in _severities(_STARTS["factory"], {"MC_LOG_LEVEL": "INFO"})
