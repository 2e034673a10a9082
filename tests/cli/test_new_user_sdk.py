"""The SDK as a new user met it, black-box: a timeout that can never be met (zero, negative, NaN)
or that gRPC cannot hold (1e10 s: a deadline past 2262) came back from every call as
DEADLINE_EXCEEDED "Deadline Exceeded", as if the broker were slow."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest

from kvrelay.client import AsyncKvRelayClient, KvRelayClient, KvRelayError
from tests.client.harness import Harness, ServerThread

BAD = [0, -1, -0.5, math.nan, math.inf, 1e10]


def _assert_timeout_refused(err: KvRelayError, value: float) -> None:
    assert (err.code, err.reason, err.details) == ("INVALID_ARGUMENT", "INVALID_ARGUMENT", {"field": "timeout"})
    assert err.message == (
        f"timeout: must be a positive number of seconds, at most 1e+09 (None: the default), got {value}"
    )


@pytest.fixture
def server() -> Iterator[ServerThread]:
    thread = ServerThread(Harness()).start()
    try:
        yield thread
    finally:
        thread.stop()


@pytest.mark.parametrize("value", BAD)
def test_a_timeout_that_can_never_be_met_is_refused_by_the_blocking_client(server: ServerThread, value: float) -> None:
    with pytest.raises(KvRelayError) as err:
        KvRelayClient(server.address, timeout=value)
    _assert_timeout_refused(err.value, value)
    with KvRelayClient(server.address) as client:
        with pytest.raises(KvRelayError) as err:
            client.generate("a fox", width=64, height=64, timeout=value)
        _assert_timeout_refused(err.value, value)
        with pytest.raises(KvRelayError) as err:
            client.list_generations(timeout=value)
        _assert_timeout_refused(err.value, value)
        # None is the default, and a positive timeout still works, the longest one included.
        assert client.generate("a fox", width=64, height=64, timeout=None).result().width == 64
        assert client.generate("a fox", width=64, height=64, timeout=1e9).result().width == 64
        assert client.list_generations(timeout=5) is not None


@pytest.mark.parametrize("value", [0, -1, math.nan, 1e10])
def test_a_timeout_that_can_never_be_met_is_refused_by_the_asyncio_client(server: ServerThread, value: float) -> None:
    async def body() -> None:
        async with AsyncKvRelayClient(server.address) as client:
            with pytest.raises(KvRelayError) as err:
                await client.generate("a fox", width=64, height=64, timeout=value)
            _assert_timeout_refused(err.value, value)
            with pytest.raises(KvRelayError) as err:
                await client.get_generation("nope", timeout=value)
            _assert_timeout_refused(err.value, value)

    asyncio.run(body())
