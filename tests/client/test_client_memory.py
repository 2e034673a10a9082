"""The SDK frees what it holds: a failed call leaves nothing for the cyclic GC (found black-box:
load scripts whose generations failed fast while the broker restarted under them spun in the
GC; every failed generation left its handle and gRPC call in a reference cycle through the error
the handle kept), close() releases the channel's sockets, a cancelled async generate leaves no
task or open call, and the blocking client shared by many threads keeps no thread or socket."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from kvrelay.client import AsyncKvRelayClient, KvRelayClient, KvRelayError, RetryPolicy
from kvrelay.v1 import generation_pb2
from tests.client.harness import Harness, ServerThread

# Re-attaches twice within 0.1 s, then gives up: the failure a restarting broker causes.
IMPATIENT = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02, reattach_seconds=0.1)
# (prompt, generate() arguments, Generate calls the harness answers UNAVAILABLE)
FAILURES: list[tuple[str, dict[str, Any], int]] = [
    ("", {}, 0),  # refused by the server: INVALID_ARGUMENT (bounds the SDK checks never leave it)
    ("fail:CHECKSUM_MISMATCH", {}, 0),  # a FAILED generation
    ("x", {"request_id": "down"}, 10_000),  # re-attached, then given up: UNAVAILABLE
]


@contextmanager
def gc_disabled() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def assert_freed(refs: list[weakref.ref[Any]]) -> None:
    alive = [ref() for ref in refs if ref() is not None]
    assert not alive, f"kept alive by a reference cycle (freed only by the cyclic GC): {alive}"


def test_a_failed_async_generation_or_call_is_freed_without_the_cyclic_gc(
    server: ServerThread, harness: Harness
) -> None:
    async def body() -> list[weakref.ref[Any]]:
        refs: list[weakref.ref[Any]] = []
        async with AsyncKvRelayClient(server.address, retry=IMPATIENT) as client:
            for prompt, fields, unavailable in FAILURES:
                harness.unavailable["Generate"] = unavailable
                handle = await client.generate(prompt, **{"width": 64, "height": 64, **fields})
                try:
                    await handle.result()
                except KvRelayError as err:
                    refs += [weakref.ref(handle), weakref.ref(err)]
                del handle
            harness.unavailable["ListReplicas"] = 10
            for call in (lambda: client.get_generation("missing"), client.list_replicas):
                try:
                    await call()
                except KvRelayError as err:
                    refs.append(weakref.ref(err))
        return refs

    with gc_disabled():
        refs = asyncio.run(body())
        assert len(refs) == 2 * len(FAILURES) + 2
        assert_freed(refs)


def test_a_failed_blocking_generation_or_call_is_freed_without_the_cyclic_gc(
    server: ServerThread, harness: Harness
) -> None:
    refs: list[weakref.ref[Any]] = []
    with gc_disabled(), KvRelayClient(server.address, retry=IMPATIENT) as client:
        for prompt, fields, unavailable in FAILURES:
            harness.unavailable["Generate"] = unavailable
            handle = client.generate(prompt, **{"width": 64, "height": 64, **fields})
            try:
                handle.result()
            except KvRelayError as err:
                refs += [weakref.ref(handle), weakref.ref(err)]
            del handle
        harness.unavailable["ListReplicas"] = 10
        calls: list[Callable[[], Any]] = [lambda: client.get_generation("missing"), client.list_replicas]
        for call in calls:
            try:
                call()
            except KvRelayError as err:
                refs.append(weakref.ref(err))
        assert len(refs) == 2 * len(FAILURES) + 2
        assert_freed(refs)


def _connections_to(port: int) -> int:
    """This process's open TCP connections to `port` (the client side; the in-process server's
    side has it as its local port), read from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if int(cols[2].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:
                    count += 1
    return count


def _no_connections_to(port: int, timeout: float = 2.0) -> bool:
    """Whether every connection to `port` is gone within `timeout` (gRPC closes a closed
    channel's socket a moment after close() returns)."""
    deadline = time.monotonic() + timeout
    while _connections_to(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _client_threads() -> int:
    """Threads of this process but the in-process server's (its loop and executor)."""
    return sum(not t.name.startswith(("asyncio_", "harness-server")) for t in threading.enumerate())


def test_close_releases_the_channels_sockets(server: ServerThread) -> None:
    # The closed clients stay referenced: their sockets must go with close(), not with the GC.
    async def use_async_clients(n: int) -> None:
        clients = [AsyncKvRelayClient(server.address) for _ in range(n)]
        for client in clients:
            await (await client.generate("x", width=64, height=64)).result()
        assert _connections_to(server.port) >= 1  # gRPC may share one connection among them
        for client in clients:
            await client.close()
        # gRPC closes the socket a moment later, on this loop's poller: let it run.
        for _ in range(100):
            if not _connections_to(server.port):
                break
            await asyncio.sleep(0.02)
        assert _connections_to(server.port) == 0

    def use_blocking_clients(n: int) -> None:
        clients = [KvRelayClient(server.address) for _ in range(n)]
        for client in clients:
            client.generate("x", width=64, height=64).result()
        assert _connections_to(server.port) >= 1  # gRPC may share one connection among them
        for client in clients:
            client.close()
        assert _no_connections_to(server.port)

    asyncio.run(use_async_clients(10))
    use_blocking_clients(10)


def test_a_cancelled_async_generate_leaves_no_task_and_no_open_call(
    server: ServerThread, harness: Harness
) -> None:
    harness.step_delay = 0.05

    async def body() -> tuple[set[asyncio.Task[Any]], list[Any], list[str]]:
        ids = []
        async with AsyncKvRelayClient(server.address) as client:
            for _ in range(10):
                handle = await client.generate("slow", width=64, height=64, num_inference_steps=100)
                try:
                    await asyncio.wait_for(handle.result(), 0.1)
                except TimeoutError:
                    pass
                ids.append(handle.request_id or "")
            await asyncio.sleep(0.2)
            calls = [call for call in list(client._open_calls) if not call.done()]
            return asyncio.all_tasks() - {asyncio.current_task()}, calls, ids  # type: ignore[return-value]

    tasks, calls, ids = asyncio.run(body())
    # One task of the client's own per loop, by design: it closes the channel when the loop ends.
    guards = {t for t in tasks if t.get_name() == "kvrelay-client-channel"}
    assert len(guards) == 1 and not tasks - guards and not calls, (tasks, calls)
    for request_id in ids:  # the dropped stream cancelled each one on the server
        server.wait_for_state(request_id, generation_pb2.GENERATION_STATE_CANCELLED)


def test_one_blocking_client_shared_by_threads_keeps_no_thread_or_socket(server: ServerThread) -> None:
    with KvRelayClient(server.address) as client:

        def generate(_: int) -> None:
            for _ in range(10):
                client.generate("x", width=64, height=64).result()

        generate(0)
        threads = _client_threads()
        for _ in range(2):
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(generate, range(8)))
            assert _client_threads() <= threads
            assert _connections_to(server.port) == 1  # one channel, one connection
    assert _client_threads() <= threads
    assert _no_connections_to(server.port)
