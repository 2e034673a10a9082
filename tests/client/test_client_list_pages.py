"""The SDK's ListGenerations pages (`list_generations_page`) against the broker's GenerationService,
and `kvrelay list` following them to its --limit (before: one page, at most 1000)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvrelay.broker.generations import GenerationParams, GenState
from kvrelay.client import AsyncKvRelayClient, Generation, GenerationPage, GenerationState, KvRelayError
from kvrelay.client.cli import _list_pages
from tests.orchestrator.harness import cluster, run


def test_list_generations_page_walks_every_generation() -> None:
    async def body() -> None:
        async with cluster() as c:
            store = c.orchestrator.store
            for i in range(7):
                record, _ = store.create_or_attach(
                    f"p{i}", GenerationParams("a cat", "", i, 64, 64, 1, 1.0), True
                )
                store.update(record, GenState.SUCCEEDED if i % 2 else GenState.CANCELLED)
            async with AsyncKvRelayClient(c.target) as client:
                seen, token = [], ""
                while True:
                    page = await client.list_generations_page(page_size=3, page_token=token)
                    assert isinstance(page, GenerationPage) and len(page.generations) <= 3
                    seen += [g.request_id for g in page.generations]
                    token = page.next_page_token
                    if not token:
                        break
                assert seen == [f"p{i}" for i in reversed(range(7))]
                first = await client.list_generations_page([GenerationState.SUCCEEDED], page_size=1)
                with pytest.raises(KvRelayError) as info:
                    await client.list_generations_page(page_size=1, page_token=first.next_page_token)
                assert (info.value.code, info.value.details.get("field")) == (
                    "INVALID_ARGUMENT",
                    "page_token",
                )
                with pytest.raises(TypeError, match="page_token must be str"):
                    await client.list_generations_page(page_token=None)  # type: ignore[arg-type]

    run(body())


@dataclass
class _Pages:
    """A client whose listing is `total` generations in pages of at most 2."""

    total: int
    asked: list[tuple[int, str]] = field(default_factory=list)

    def list_generations_page(self, states: object, *, page_size: int, page_token: str) -> GenerationPage:
        self.asked.append((page_size, page_token))
        start = int(page_token or 0)
        end = min(self.total, start + min(page_size, 2))
        made = [Generation(f"g{i}", GenerationState.SUCCEEDED, None, 0, 0, None, None, None, "", None, None)
                for i in range(start, end)]  # fmt: skip
        return GenerationPage(made, str(end) if end < self.total else "")


@pytest.mark.parametrize(("total", "limit", "listed"), [(5, 0, 5), (5, 3, 3), (5, 9, 5), (0, 0, 0)])
def test_kvrelay_list_follows_pages_to_its_limit(total: int, limit: int, listed: int) -> None:
    client = _Pages(total)
    got = _list_pages(client, None, limit)  # type: ignore[arg-type]
    assert [g.request_id for g in got] == [f"g{i}" for i in range(listed)]
    assert all(size >= 1 for size, _ in client.asked)
