"""The DiT's denoise batcher (pure asyncio): ready requests of one shape go together, up to
max_batch, oldest first; nothing waits for a batch to fill; errors reach every member."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from kvrelay.dit_service.batcher import DenoiseBatcher


@dataclass(frozen=True)
class Item:
    name: str
    width: int = 512
    height: int = 512
    steps: int = 2


def test_requests_ready_while_a_batch_runs_form_the_next_batch() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        batches: list[list[str]] = []

        async def run(items: list[Item]) -> list[list[str]]:
            batches.append([i.name for i in items])
            if len(batches) == 1:
                await gate.wait()
            return [[f"r0:{i.name}" for i in items], [f"r1:{i.name}" for i in items]]

        batcher = DenoiseBatcher(run, max_batch=3)
        first = asyncio.ensure_future(batcher.submit(Item("a")))
        await asyncio.sleep(0)
        others = [asyncio.ensure_future(batcher.submit(Item(n))) for n in "bcde"]
        odd = asyncio.ensure_future(batcher.submit(Item("big", width=1024)))
        await asyncio.sleep(0.01)
        assert batches == [["a"]]  # an idle replica starts at once: no waiting to fill a batch
        gate.set()
        assert await first == ["r0:a", "r1:a"]
        assert [await t for t in others] == [[f"r0:{n}", f"r1:{n}"] for n in "bcde"]
        assert await odd == ["r0:big", "r1:big"]
        assert batches == [["a"], ["b", "c", "d"], ["e"], ["big"]]
        assert batcher.batch_sizes == [1, 3, 1, 1]

    asyncio.run(main())


def test_a_failed_batch_fails_each_member_and_the_next_batch_still_runs() -> None:
    async def main() -> None:
        calls = 0

        async def run(items: list[Item]) -> list[list[str]]:
            nonlocal calls
            calls += 1
            await asyncio.sleep(0.01)
            if calls == 1:
                raise RuntimeError("rank failed")
            return [[i.name for i in items]]

        batcher = DenoiseBatcher(run, max_batch=2)
        a = asyncio.ensure_future(batcher.submit(Item("a")))
        await asyncio.sleep(0)
        b = asyncio.ensure_future(batcher.submit(Item("b")))
        c = asyncio.ensure_future(batcher.submit(Item("c")))
        with pytest.raises(RuntimeError, match="rank failed"):
            await a
        assert await b == ["b"] and await c == ["c"]

    asyncio.run(main())


def test_a_caller_gone_before_its_batch_is_left_out() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        batches: list[list[str]] = []

        async def run(items: list[Item]) -> list[list[str]]:
            batches.append([i.name for i in items])
            await gate.wait()
            return [[i.name for i in items]]

        batcher = DenoiseBatcher(run, max_batch=4)
        a = asyncio.ensure_future(batcher.submit(Item("a")))
        await asyncio.sleep(0)
        b = asyncio.ensure_future(batcher.submit(Item("b")))
        c = asyncio.ensure_future(batcher.submit(Item("c")))
        await asyncio.sleep(0)
        b.cancel()
        gate.set()
        await a
        assert await c == ["c"]
        assert batches == [["a"], ["c"]]
        with pytest.raises(ValueError):
            DenoiseBatcher(run, max_batch=0)

    asyncio.run(main())


def test_withdraw_takes_back_an_item_only_before_its_batch_starts() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        batches: list[list[str]] = []

        async def run(items: list[Item]) -> list[list[str]]:
            batches.append([i.name for i in items])
            await gate.wait()
            return [[i.name for i in items]]

        batcher = DenoiseBatcher(run, max_batch=1)
        a_item, b_item, c_item = Item("a"), Item("b"), Item("c")
        a = asyncio.ensure_future(batcher.submit(a_item))
        await asyncio.sleep(0)
        b = asyncio.ensure_future(batcher.submit(b_item))
        c = asyncio.ensure_future(batcher.submit(c_item))
        await asyncio.sleep(0)
        assert not batcher.withdraw(a_item)  # running: only its ranks can stop it
        assert batcher.withdraw(b_item)
        assert not batcher.withdraw(b_item)  # already taken back
        await asyncio.wait({b})
        assert b.cancelled()
        gate.set()
        assert await a == ["a"] and await c == ["c"]
        assert batches == [["a"], ["c"]]
        assert not batcher.withdraw(c_item)  # ran

    asyncio.run(main())
