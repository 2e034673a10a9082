"""Batching of waiting Prefill calls into one prefill on the ranks (issue 15: "the AR prefills
several tickets at once").

Owns one rule: when the ranks are free, the tickets waiting here go into the next batch, oldest
first, up to `max_batch` tickets and `max_tokens` tokens (the oldest always goes, however long),
and, with `max_blocks`, up to that many engine KV blocks (`blocks(item)`: a vLLM AR's whole cache,
which every ticket of a batch holds at once until its turn); the others wait for the batch after. It never waits for more tickets to arrive (an idle replica
starts a batch of one at once). Only the prefill is shared: the batch then gives each member its
turn with the ranks, one at a time in batch order, and holds the ranks lock (`ranks`) from the
prefill until the last member's turn has ended, so a ticket's prefill, arming and writes never
interleave with another batch's. Pure asyncio: no gRPC, no broker, no ranks (the runner callable
sends the batch to them and returns one result per item).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class PrefillItem(Protocol):
    @property
    def num_tokens(self) -> int: ...


# run(items) -> one result per item, in item order; a result that is an exception is raised to
# that item's caller alone. An exception out of run itself is raised to every member.
PrefillRunner = Callable[[list[Any]], Awaitable[Sequence[Any]]]
# discard(item, result): a member's caller went away before its turn; result is what the
# prefill gave it (the caller of the batcher frees what that holds).
Discard = Callable[[Any, Any], None]


@dataclass(slots=True, eq=False)
class _Member:
    item: Any
    result: asyncio.Future[Any]
    turn_over: asyncio.Event = field(default_factory=asyncio.Event)


class PrefillBatcher:
    """``async with batcher.turn(item) as result:`` waits for the item's batch to be prefilled,
    then runs the body as the item's turn with the ranks (the batch holds `ranks` for it)."""

    def __init__(
        self,
        run: PrefillRunner,
        ranks: asyncio.Lock,
        *,
        max_batch: int,
        max_tokens: int,
        discard: Discard | None = None,
        blocks: Callable[[Any], int] | None = None,
        max_blocks: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run = run
        self._ranks = ranks
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self._discard = discard
        # 0: no block budget. A batch of tickets that each fit the engine's cache but not
        # together failed every ticket past the free blocks (PREFILL_FAILED) instead of waiting.
        self._blocks = blocks
        self.max_blocks = max_blocks if blocks is not None else 0
        self._pending: list[_Member] = []
        self._loop_task: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # items of every batch taken so far (tests)

    @property
    def waiting(self) -> int:
        return sum(1 for m in self._pending if not m.result.done())

    @contextlib.asynccontextmanager
    async def turn(self, item: PrefillItem) -> AsyncIterator[Any]:
        member = _Member(item, asyncio.get_running_loop().create_future())
        self._pending.append(member)
        if self._loop_task is None or self._loop_task.done():
            # A fresh context: the loop serves every caller, so it must not carry (and log with)
            # the request ids bound in the context of the caller that happened to start it.
            self._loop_task = asyncio.get_running_loop().create_task(self._drain(), context=contextvars.Context())
        try:
            try:
                result = await member.result
            except asyncio.CancelledError:
                # Gone between its batch's prefill and its turn: free what the prefill gave it.
                if member.result.done() and not member.result.cancelled() and member.result.exception() is None:
                    self._discard_result(member, member.result.result())
                raise
            yield result
        finally:
            member.turn_over.set()

    def _take(self) -> list[_Member]:
        live = [m for m in self._pending if not m.result.done()]
        batch: list[_Member] = []
        tokens = blocks = 0
        for member in live:
            if len(batch) == self.max_batch:
                break
            if batch and tokens + member.item.num_tokens > self.max_tokens:
                break  # oldest first: a later, shorter ticket does not jump the queue
            need = self._blocks(member.item) if self._blocks is not None and self.max_blocks else 0
            if batch and blocks + need > self.max_blocks:
                break
            batch.append(member)
            tokens += member.item.num_tokens
            blocks += need
        self._pending = live[len(batch) :]
        return batch

    async def _drain(self) -> None:
        while True:
            async with self._ranks:
                batch = self._take()
                if not batch:
                    return
                self.batch_sizes.append(len(batch))
                try:
                    results: Sequence[Any] = await self._run([m.item for m in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"prefill runner gave {len(results)} results for {len(batch)} items")
                except Exception as err:  # noqa: BLE001 - handed to every member of the batch
                    results = [err] * len(batch)
                for member, result in zip(batch, results, strict=True):
                    if member.result.done():
                        # Its caller went away while the batch ran.
                        if not isinstance(result, BaseException):
                            self._discard_result(member, result)
                        continue
                    if isinstance(result, BaseException):
                        member.result.set_exception(result)
                    else:
                        member.result.set_result(result)
                    # One turn at a time, in batch order, while the batch holds the ranks.
                    await member.turn_over.wait()

    def _discard_result(self, member: _Member, result: Any) -> None:
        if self._discard is not None:
            self._discard(member.item, result)
