"""Batching of admitted Denoise calls into one rank command (issue 15: `max_num_seqs > 1` really
batches).

Owns one rule: when the ranks are free, every denoise that is ready (loaded, waiting here) and
shares the oldest one's image size and step count goes into the next batch, up to `max_batch`,
oldest first; the others wait for the batch after. It never waits for more requests to arrive
(an idle replica starts a batch of one at once), so a request's load overlaps the running batch
instead of delaying it. Pure asyncio: no gRPC, no pages, no ranks (the runner callable sends the
batch to them and returns each rank's per-item results).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol


class BatchItem(Protocol):
    # Read-only: a frozen dataclass (RunDenoise) is an item.
    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...
    @property
    def steps(self) -> int: ...


# run(items) -> per rank, one result per item (in item order).
BatchRunner = Callable[[list[Any]], Awaitable[Sequence[Sequence[Any]]]]


class DenoiseBatcher:
    """``await batcher.submit(item)`` returns ``[rank 0's result, rank 1's, ...]`` for the item
    once the batch it ran in has finished; an error of that batch is raised to every member."""

    def __init__(self, run: BatchRunner, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._run = run
        self.max_batch = max_batch
        self._pending: list[tuple[Any, asyncio.Future[list[Any]]]] = []
        self._loop_task: asyncio.Task[None] | None = None
        self.batch_sizes: list[int] = []  # every batch run so far (metrics and tests)

    @property
    def waiting(self) -> int:
        return sum(1 for _, f in self._pending if not f.done())

    async def submit(self, item: BatchItem) -> list[Any]:
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.ensure_future(self._drain())
        # A caller that goes away before its batch starts cancels the future: it is skipped.
        return await future

    def withdraw(self, item: BatchItem) -> bool:
        """Take back an item whose batch has not started (its caller is gone): True if it was
        still waiting here (its ``submit`` is cancelled; no rank ever sees it), False if its batch
        runs or ran."""
        for pending in self._pending:
            if pending[0] is item and not pending[1].done():
                self._pending.remove(pending)
                pending[1].cancel()
                return True
        return False

    def _take(self) -> list[tuple[Any, asyncio.Future[list[Any]]]]:
        live = [(item, f) for item, f in self._pending if not f.done()]
        if not live:
            self._pending = []
            return []
        key = _shape(live[0][0])
        batch = [p for p in live if _shape(p[0]) == key][: self.max_batch]
        chosen = {id(f) for _, f in batch}
        self._pending = [p for p in live if id(p[1]) not in chosen]
        return batch

    async def _drain(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            self.batch_sizes.append(len(batch))
            try:
                per_rank = await self._run([item for item, _ in batch])
            except Exception as err:  # noqa: BLE001 - handed to every member of the batch
                for _, f in batch:
                    if not f.done():
                        f.set_exception(err)
                continue
            for idx, (_, f) in enumerate(batch):
                if not f.done():
                    f.set_result([rank_results[idx] for rank_results in per_rank])


def _shape(item: BatchItem) -> tuple[int, int, int]:
    return (item.width, item.height, item.steps)
