"""The benchmark scripts' own gRPC listeners are built like every kvrelay server's
(kvrelay.security.server_options): with the keepalive ping permits, a client that pings an idle
stream every 15 s (every kvrelay channel does) is not sent GOAWAY too_many_pings mid-run."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from kvrelay.security import Credentials, server_options

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["transfer_bench", "broker_bench"])
def test_bench_listeners_carry_the_keepalive_ping_permits(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[dict[str, Any]] = []
    real_server = grpc.aio.server

    def recording_server(*args: Any, **kwargs: Any) -> Any:
        built.append(dict(kwargs.get("options") or ()))
        return real_server(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", recording_server)
    module = load_script(script)

    async def build() -> None:  # a grpc.aio server is made on a running event loop, as the scripts do
        module.grpc_server()

    asyncio.run(build())
    assert len(built) == 1
    options = built[0]
    assert options == dict(server_options(Credentials()))
    # What a plain grpc.aio.server() lacks: pings from idle clients allowed every 5 s (gRPC's
    # default, 5 minutes, strikes a 15 s keepalive), and the server pinging back.
    assert options["grpc.http2.min_ping_interval_without_data_ms"] <= 7500
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 0


def test_no_bench_script_builds_a_plain_grpc_server() -> None:
    """A new script (or a new listener in one) goes through kvrelay.security.server_options."""
    plain = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "grpc.aio.server(" in line and "server_options(" not in line:
                plain.append(f"{path.name}:{number}: {line.strip()}")
    assert plain == []
