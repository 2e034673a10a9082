"""Replies carrying an image are bounded while their peer does not read them, and given back when
the call ends (found black-box: a client that asked for a finished 2048x2048 image 50 times over
one connection and never read grew the broker by 1.7 GB, ~35 MB per call, freed only when it
disconnected)."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import grpc
import pytest

from kvrelay.v1 import generation_pb2

from .harness import cluster, collect, error_info, request, run

S = generation_pb2
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS = 0x0, 0x1, 0x4
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
SETTINGS_INITIAL_WINDOW_SIZE = 0x4


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding."""
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def _unread_calls(authority: str, method: str, message: bytes, calls: int) -> bytes:
    """A client preface announcing a stream window of 0 (the broker may send no reply data),
    then `calls` unary calls of `method`: what a peer that never reads looks like to gRPC."""
    headers = b"".join(
        _literal(k, v)
        for k, v in (
            (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", authority),
            ("content-type", "application/grpc"), ("te", "trailers"),
        )
    )  # fmt: skip
    body = b"\x00" + struct.pack(">I", len(message)) + message
    out = PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, 0))
    out += _frame(SETTINGS, ACK, 0)
    for i in range(calls):
        out += _frame(HEADERS, END_HEADERS, 2 * i + 1, headers) + _frame(DATA, END_STREAM, 2 * i + 1, body)
    return out


def test_unread_image_replies_hold_a_bounded_budget_until_their_calls_end() -> None:
    async def body() -> None:
        # The deployment's bounds (broker.image_reply_*): one image is let through alone; every
        # further image reply waits for it, then is refused.
        async with cluster(image_reply_budget_bytes=1, image_reply_wait_seconds=0.2) as c:
            events = await collect(c.api.Generate(request(request_id="img", seed=1), timeout=10))
            png = events[-1].image.png
            get = S.GetGenerationRequest(request_id="img")
            host, port = c.target.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_unread_calls(
                c.target, "/kvrelay.v1.GenerationService/GetGeneration", get.SerializeToString(), 5
            ))  # fmt: skip
            await writer.drain()
            # While the unread replies are held, a reader's image reply waits, then is refused.
            deadline = time.monotonic() + 5
            while True:
                try:
                    await c.api.GetGeneration(get, timeout=5)
                except grpc.aio.AioRpcError as err:
                    code, reason, _ = error_info(err)
                    assert (code, reason) == (
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "IMAGE_REPLY_BUDGET_EXHAUSTED",
                    )
                    break
                assert time.monotonic() < deadline, "the unread replies held no budget"
                await asyncio.sleep(0.05)
            # A Generate stream's terminal event carries the image too.
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await collect(c.api.Generate(request(request_id="img", seed=1), timeout=5))
            assert error_info(exc.value)[:2] == (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "IMAGE_REPLY_BUDGET_EXHAUSTED",
            )
            # The peer goes away: its calls end and give their bytes back.
            writer.close()
            await writer.wait_closed()
            deadline = time.monotonic() + 5
            while True:
                try:
                    got = (await c.api.GetGeneration(get, timeout=5)).generation
                    break
                except grpc.aio.AioRpcError as err:
                    assert error_info(err)[1] == "IMAGE_REPLY_BUDGET_EXHAUSTED"
                    assert time.monotonic() < deadline, "the budget was not given back"
            assert got.image.png == png
            # Replies that were read gave theirs back too: nothing is held once the calls ended.
            for _ in range(3):
                assert (await c.api.GetGeneration(get, timeout=5)).generation.image.png == png
            assert (await collect(c.api.Generate(request(request_id="img", seed=1), timeout=5)))[
                -1
            ].image.png == png

    run(body())


class _Call:
    """What ImageReplyBudget uses of a grpc.aio.ServicerContext."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []
        self.ended = False

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def done(self) -> bool:
        return self.ended

    def time_remaining(self) -> float | None:
        return None

    def end(self) -> None:
        self.ended = True
        for callback in self.callbacks:
            callback(self)


def test_the_budget_serves_waiters_in_order_and_gets_every_byte_back() -> None:
    from kvrelay.broker.generation import ImageReplyBudget
    from kvrelay.errors import KvRelayServerError

    async def body() -> None:
        budget = ImageReplyBudget(limit_bytes=100, wait_seconds=5)
        a, b, c, d = _Call(), _Call(), _Call(), _Call()
        await budget.reserve(60, a)  # type: ignore[arg-type]
        waiting_b = asyncio.create_task(budget.reserve(60, b))  # type: ignore[arg-type]
        waiting_c = asyncio.create_task(budget.reserve(10, c))  # fits, but waits behind b
        await asyncio.sleep(0.01)
        assert budget.held_bytes == 60 and not waiting_b.done() and not waiting_c.done()
        a.end()
        await asyncio.gather(waiting_b, waiting_c)
        assert budget.held_bytes == 70
        # A waiter whose task is cancelled takes nothing; one that times out is refused.
        waiting_d = asyncio.create_task(budget.reserve(50, d))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        waiting_d.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting_d
        budget.wait_seconds = 0.01
        with pytest.raises(KvRelayServerError) as exc:
            await budget.reserve(50, _Call())  # type: ignore[arg-type]
        assert exc.value.reason == "IMAGE_REPLY_BUDGET_EXHAUSTED"
        b.end()
        c.end()
        c.end()  # a second callback gives nothing back twice
        assert budget.held_bytes == 0
        # A call that ended before its callback was added gives its bytes back at once.
        gone = _Call()
        gone.ended = True
        await budget.reserve(500, gone)  # type: ignore[arg-type]
        assert budget.held_bytes == 0

    run(body())
