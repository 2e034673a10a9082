"""The asyncio SDK against the same real gRPC server."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from PIL import Image

from kvrelay.client import AsyncKvRelayClient, GenerationState, KvRelayError, RetryPolicy
from kvrelay.v1 import generation_pb2
from tests.client.harness import Harness, ServerThread

S = GenerationState
PB = generation_pb2.GenerationState
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


def run(address: str, body: Callable[[AsyncKvRelayClient], Awaitable[Any]], **options: Any) -> Any:
    async def main() -> Any:
        async with AsyncKvRelayClient(address, retry=FAST_RETRY, **options) as client:
            return await asyncio.wait_for(body(client), 30)

    return asyncio.run(main())


def test_async_generate_streams_stages_and_returns_the_png(server: ServerThread) -> None:
    async def body(client: AsyncKvRelayClient) -> tuple[list[Any], Any]:
        handle = await client.generate("a fox", seed=9, width=96, height=64, num_inference_steps=2)
        events = [event async for event in handle.events()]
        return events, await handle.result()

    events, result = run(server.address, body)
    assert [e.state for e in events] == [
        S.QUEUED,
        S.PREFILLING,
        S.TRANSFERRING,
        S.DENOISING,
        S.DENOISING,
        S.SUCCEEDED,
    ]
    assert Image.open(io.BytesIO(result.png)).size == (96, 64)
    assert result.seed == 9 and result.request_id == events[0].request_id


def test_async_errors_are_kvrelay_errors(server: ServerThread) -> None:
    async def body(client: AsyncKvRelayClient) -> list[KvRelayError]:
        errors = []
        for action in (
            lambda: _result(client.generate("x", height=70)),
            lambda: client.get_generation("missing"),
            lambda: _result(client.generate("fail:CHECKSUM_MISMATCH", width=64, height=64)),
        ):
            try:
                await action()
            except KvRelayError as err:
                errors.append(err)
        return errors

    bad_height, missing, failed = run(server.address, body)
    assert not isinstance(bad_height, grpc.RpcError)
    assert (bad_height.code, bad_height.details["field"]) == ("INVALID_ARGUMENT", "height")
    assert (missing.code, missing.reason) == ("NOT_FOUND", "GENERATION_NOT_FOUND")
    assert (failed.code, failed.reason) == ("DEADLINE_EXCEEDED", "CHECKSUM_MISMATCH")


async def _result(handle_coro: Awaitable[Any]) -> Any:
    handle = await handle_coro
    return await handle.result()


def test_async_cancel_from_another_task_cancels_on_the_server(server: ServerThread, harness: Harness) -> None:
    harness.step_delay = 0.1

    async def body(client: AsyncKvRelayClient) -> tuple[list[GenerationState], str]:
        handle = await client.generate("slow", width=64, height=64, num_inference_steps=300)
        states: list[GenerationState] = []

        async def consume() -> None:
            async for event in handle.events():
                states.append(event.state)

        consumer = asyncio.create_task(consume())
        while S.DENOISING not in states:
            await asyncio.sleep(0.01)
        await handle.cancel()
        await asyncio.wait_for(consumer, 5)
        with pytest.raises(KvRelayError) as info:
            await handle.result()
        assert info.value.code == "CANCELLED"
        return states, handle.request_id or ""

    states, request_id = run(server.address, body)
    assert states[-1] == S.CANCELLED
    assert harness.calls["CancelGeneration"] == 1
    generation = server.wait_for_state(request_id, PB.GENERATION_STATE_CANCELLED)
    assert generation.step < 300


def test_cancelling_the_consuming_task_still_propagates(server: ServerThread, harness: Harness) -> None:
    harness.step_delay = 0.1

    async def body(client: AsyncKvRelayClient) -> str:
        handle = await client.generate("slow", width=64, height=64, num_inference_steps=300)

        async def consume() -> None:
            async for _ in handle.events():
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with handle:  # leaving the block cancels the unfinished generation
            pass
        return handle.request_id or ""

    request_id = run(server.address, body)
    server.wait_for_state(request_id, PB.GENERATION_STATE_CANCELLED)


def test_async_deadline_retry_and_reattach(server: ServerThread, harness: Harness) -> None:
    async def body(client: AsyncKvRelayClient) -> list[str]:
        codes = []
        harness.step_delay = 0.2
        try:
            await _result(client.generate("slow", width=64, height=64, num_inference_steps=100, timeout=0.6))
        except KvRelayError as err:
            codes.append(err.code)
        harness.step_delay = 0.01
        harness.unavailable["ListGenerations"] = 2
        await client.list_generations()
        harness.break_stream_after, harness.break_streams = 3, 1
        handle = await client.generate("y", width=64, height=64, request_id="ra-1")
        codes.append((await handle.result()).request_id)
        harness.unavailable["Generate"] = 1
        try:
            await _result(client.generate("z", width=64, height=64))
        except KvRelayError as err:
            codes.append(err.code)
        return codes

    assert run(server.address, body) == ["DEADLINE_EXCEEDED", "ra-1", "UNAVAILABLE"]
    assert 0 < harness.deadlines["Generate"][0] <= 0.65
    assert harness.calls["ListGenerations"] == 3
    assert harness.calls["Generate"] == 1 + 2 + 1  # deadline; ra-1 + one re-attach; no retry without an id
    assert "ra-1" in harness.generations


def test_async_status_reads_and_token(server: ServerThread, harness: Harness) -> None:
    harness.token = "t0k"

    async def body(client: AsyncKvRelayClient) -> tuple[list[Any], list[Any], list[Any]]:
        return await client.list_replicas(), await client.get_pools(), await client.list_tickets()

    assert run(server.address, body, token="t0k") == ([], [], [])
    with pytest.raises(KvRelayError) as info:
        run(server.address, body)
    assert info.value.code == "UNAUTHENTICATED"


def test_async_close_drops_an_open_stream_and_later_calls_are_kvrelay_errors(
    server: ServerThread, harness: Harness
) -> None:
    harness.step_delay = 0.1

    async def main() -> tuple[str, list[KvRelayError]]:
        client = AsyncKvRelayClient(server.address, retry=FAST_RETRY)
        handle = await client.generate("slow", width=64, height=64, num_inference_steps=300)
        states: list[GenerationState] = []

        async def consume() -> None:
            async for event in handle.events():
                states.append(event.state)

        consumer = asyncio.create_task(consume())
        while S.DENOISING not in states:
            await asyncio.sleep(0.01)
        await client.close()
        errors = []
        # grpc.aio's close() left the stream running to SUCCEEDED; the iteration now fails at once.
        for action in (
            lambda: asyncio.wait_for(consumer, 5),
            lambda: client.generate("x"),
            lambda: client.get_generation("missing"),
        ):
            with pytest.raises(KvRelayError) as info:
                await action()
            errors.append(info.value)
        await client.close()  # idempotent
        return handle.request_id or "", errors

    request_id, errors = asyncio.run(main())
    assert [(e.code, e.reason) for e in errors] == [("CANCELLED", "CLIENT_CLOSED")] * 3
    server.wait_for_state(request_id, PB.GENERATION_STATE_CANCELLED)
    assert harness.generations[request_id].cancelled_by == "stream_dropped"


def test_async_events_of_an_ended_generation_repeat_only_its_terminal_event(server: ServerThread) -> None:
    async def body(client: AsyncKvRelayClient) -> tuple[list[Any], list[Any]]:
        handle = await client.generate("a fox", width=64, height=64, num_inference_steps=2)
        first = [event async for event in handle.events()]
        return first, [event async for event in handle.events()]

    first, second = run(server.address, body)
    assert first[-1].state == S.SUCCEEDED and second == [first[-1]]


def test_async_result_beside_an_events_iteration_returns_the_image_and_the_iteration_sees_every_event(
    server: ServerThread, harness: Harness
) -> None:
    # Found black-box: asyncio.gather(handle.result(), a task iterating handle.events()) made one
    # of them fail UNAVAILABLE STREAM_ENDED (two readers of one stream) although the generation
    # succeeded, and an iterator left open after its first event yielded nothing once result()
    # had read the rest. A second concurrent events() is a RuntimeError, as with the blocking handle.
    harness.step_delay = 0.01

    async def states(handle: Any) -> list[Any]:
        return [event.state async for event in handle.events()]

    async def body(client: AsyncKvRelayClient) -> tuple[Any, ...]:
        handle = await client.generate("x", width=64, height=64, num_inference_steps=5)
        result, seen = await asyncio.gather(handle.result(), states(handle))
        handle = await client.generate("x", width=64, height=64, num_inference_steps=5)
        both = await asyncio.gather(states(handle), states(handle), return_exceptions=True)
        handle = await client.generate("x", width=64, height=64, num_inference_steps=5)
        events = handle.events()
        first = (await events.__anext__()).state
        later = await handle.result()
        rest = [event.state async for event in events]
        return result, seen, both, first, later, rest

    result, seen, both, first, later, rest = run(server.address, body)
    assert result.width == 64 and seen[-1] == S.SUCCEEDED and seen.count(S.DENOISING) == 5, seen
    assert sum(isinstance(x, RuntimeError) for x in both) == 1, both
    assert [x for x in both if isinstance(x, list)][0][-1] == S.SUCCEEDED
    assert first == S.QUEUED and later.width == 64
    assert rest[-1] == S.SUCCEEDED and rest.count(S.DENOISING) == 5, rest


def test_async_client_made_outside_the_loop_works_in_each_loop_that_uses_it(server: ServerThread) -> None:
    # Found black-box: a client made at module level / in sync code and used inside asyncio.run()
    # failed with grpc's raw "attached to a different loop" RuntimeError.
    client = AsyncKvRelayClient(server.address, retry=FAST_RETRY)

    async def body() -> tuple[int, GenerationState]:
        replicas = await client.list_replicas()
        handle = await client.generate("a fox", seed=3, width=64, height=64)
        result = await asyncio.wait_for(handle.result(), 30)
        return len(replicas), (await client.get_generation(result.request_id)).state

    first = asyncio.run(body())
    # The first loop is closed now; a later asyncio.run() gets a fresh channel.
    assert asyncio.run(body()) == first
    assert first[1] is S.SUCCEEDED
    asyncio.run(client.close())
    with pytest.raises(KvRelayError) as closed:
        asyncio.run(client.list_replicas())
    assert closed.value.reason == "CLIENT_CLOSED"


def test_async_client_in_use_by_an_open_loop_refuses_a_second_loop_clearly(server: ServerThread) -> None:
    client = AsyncKvRelayClient(server.address, retry=FAST_RETRY)
    first_loop = asyncio.new_event_loop()
    try:
        first_loop.run_until_complete(client.list_replicas())
        with pytest.raises(KvRelayError) as wrong:
            asyncio.run(client.list_replicas())
        assert (wrong.value.code, wrong.value.reason) == ("FAILED_PRECONDITION", "WRONG_EVENT_LOOP")
        assert "one client per event loop" in wrong.value.message
        first_loop.run_until_complete(client.list_replicas())  # still fine in its own loop
        first_loop.run_until_complete(client.close())
    finally:
        first_loop.close()


def test_async_client_closed_before_any_use_opens_no_channel() -> None:
    client = AsyncKvRelayClient("127.0.0.1:1")
    asyncio.run(client.close())
    with pytest.raises(KvRelayError) as closed:
        asyncio.run(client.get_generation("x"))
    assert closed.value.reason == "CLIENT_CLOSED"
    assert client._channel is None


def test_a_timeout_around_result_leaves_the_handle_usable(server: ServerThread, harness: Harness) -> None:
    """asyncio.wait_for / asyncio.timeout around result() or events() cancel the reading task, and
    grpc.aio cancels the Generate call with it. Found black-box: the next result() raised a bare
    asyncio.CancelledError (from a task nobody cancelled), also with a request_id the broker was
    keeping the generation for. Now, with a request_id, it re-attaches and returns the image;
    without one (the broker cancels the generation when its stream drops) it raises KvRelayError
    CANCELLED / STREAM_CANCELLED saying so."""
    harness.step_delay = 0.05

    async def body(client: AsyncKvRelayClient) -> tuple[Any, list[Any], KvRelayError, str]:
        kept = await client.generate("kept", width=64, height=64, num_inference_steps=20, request_id="wf-1")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(kept.result(), 0.3)
        result = await kept.result()
        followed = await client.generate("followed", width=64, height=64, num_inference_steps=20, request_id="wf-2")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                async for _ in followed.events():
                    pass
        rest = [event.state async for event in followed.events()]
        dropped = await client.generate("dropped", width=64, height=64, num_inference_steps=20)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(dropped.result(), 0.3)
        with pytest.raises(KvRelayError) as info:
            await dropped.result()
        return result, rest, info.value, dropped.request_id or ""

    result, rest, error, dropped_id = run(server.address, body)
    assert result.request_id == "wf-1" and result.png
    assert rest[-1] == S.SUCCEEDED and S.DENOISING in rest
    assert harness.calls["Generate"] == 2 + 2 + 1  # each request_id stream re-attached once; no re-attach without
    assert (error.code, error.reason) == ("CANCELLED", "STREAM_CANCELLED"), error
    assert "request_id" in error.message
    assert server.wait_for_state(dropped_id, PB.GENERATION_STATE_CANCELLED).state == PB.GENERATION_STATE_CANCELLED


# A user's program: a grpc.aio server on a loop in another thread (as an app serving beside its
# client would; the SDK's test harness too) and the client in one asyncio.run() after another,
# each closing its client (`async with`) with a stream still open (left after one event) or just
# ended (read to SUCCEEDED, its status still on the way).
_LOOPS_CLOSE_QUIETLY = """
import asyncio
from kvrelay.client import AsyncKvRelayClient
from tests.client.harness import Harness, ServerThread

server = ServerThread(Harness()).start()

async def main(leave_early):
    async with AsyncKvRelayClient(server.address) as client:
        handle = await client.generate("a fox", seed=1, width=64, height=64, num_inference_steps=3)
        async for event in handle.events():
            if leave_early:
                break

for i in range(40):
    asyncio.run(main(leave_early=i % 2 == 0))
server.stop()
print("ran 40 loops")
"""


def test_closing_the_client_then_its_loop_prints_nothing_from_grpc() -> None:
    """Found in CI's output: close() cancelled the open streams and returned while grpc's core had
    not answered them yet; asyncio.run then closed the loop, and the answer, taken by the server's
    loop, came to a closed one: "Exception in callback PollerCompletionQueue._handle_events ...
    RuntimeError: Event loop is closed" on stderr (about one loop in two, without the fix)."""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _LOOPS_CLOSE_QUIETLY], capture_output=True, text=True, timeout=120, cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert done.returncode == 0 and "ran 40 loops" in done.stdout, done.stdout + done.stderr
    for noise in ("Event loop is closed", "Task was destroyed"):
        assert noise not in done.stderr, done.stderr[-3000:]


# The same program with one client for every loop, never closed: made at module level and used
# in one asyncio.run() after another (a stream left open after one event, or read to its end),
# then in a loop that is closed without cancelling its tasks (run_until_complete, close()).
_ONE_CLIENT_MANY_LOOPS = """
import asyncio, gc
from kvrelay.client import AsyncKvRelayClient
from tests.client.harness import Harness, ServerThread

server = ServerThread(Harness()).start()
client = AsyncKvRelayClient(server.address)

async def main(leave_early):
    await client.list_replicas()
    handle = await client.generate("a fox", seed=1, width=64, height=64, num_inference_steps=3)
    states = [event.state.name async for event in _events(handle, leave_early)]
    return states[-1]

async def _events(handle, leave_early):
    async for event in handle.events():
        yield event
        if leave_early:
            return

ends = [asyncio.run(main(leave_early=i % 2 == 0)) for i in range(40)]
loop = asyncio.new_event_loop()
loop.run_until_complete(client.list_replicas())
loop.close()
assert len(asyncio.run(client.list_replicas())) >= 0
gc.collect()
server.stop()
print("ran", len(ends), "loops, last states", sorted(set(ends)))
"""


def test_one_client_in_loop_after_loop_without_close_prints_nothing_from_grpc() -> None:
    """Found black-box (docs/client.md said it was known): a client used in one asyncio.run()
    and not closed there left its open stream (or the status of one read to its end) to grpc,
    which answered after the loop had closed; the next loop to use grpc (the client's own, in the
    next asyncio.run(), or a server's) logged "Exception in callback
    PollerCompletionQueue._handle_events ... RuntimeError: Event loop is closed" (5-8 times in 40
    loops). Now the client closes its channel when its loop ends (asyncio.run cancels every task
    of the loop first, its guard too) and the next loop opens a fresh one."""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _ONE_CLIENT_MANY_LOOPS], capture_output=True, text=True, timeout=180, cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert done.returncode == 0 and "ran 40 loops" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "'QUEUED'" in done.stdout or "'SUCCEEDED'" in done.stdout, done.stdout
    for noise in ("Event loop is closed", "Task was destroyed", "attached to a different loop"):
        assert noise not in done.stderr, done.stderr[-3000:]
