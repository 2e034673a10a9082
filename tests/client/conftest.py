"""Fixtures for the SDK tests: a real gRPC server (tests/client/harness.py) on a free port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.client.harness import Harness, ServerThread


@pytest.fixture
def server() -> Iterator[ServerThread]:
    thread = ServerThread(Harness()).start()
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture
def harness(server: ServerThread) -> Harness:
    return server.harness
