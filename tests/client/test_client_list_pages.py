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


@dataclass
class _RateLimitedPages(_Pages):
    """`_Pages` whose broker refuses the listed calls (by number) RATE_LIMITED, naming the wait."""

    refused: tuple[int, ...] = ()
    retry_after_ms: str = "250"
    calls: int = 0

    def list_generations_page(self, states: object, *, page_size: int, page_token: str) -> GenerationPage:
        self.calls += 1
        if self.calls in self.refused:
            raise KvRelayError("RESOURCE_EXHAUSTED", "RATE_LIMITED", "slow down",
                               {"retry_after_ms": self.retry_after_ms})  # fmt: skip
        return super().list_generations_page(states, page_size=page_size, page_token=page_token)


def test_kvrelay_list_waits_out_a_rate_limited_page_for_as_long_as_the_broker_says() -> None:
    """A page's reply counts its bytes against the caller's bucket (kvrelay.security.
    list_generations_reply_cost): a walk over many retained prompts is refused RATE_LIMITED part
    way, and `kvrelay list` asks the same page again after the named wait instead of failing."""
    client = _RateLimitedPages(5, refused=(2, 3))
    slept: list[float] = []
    got = _list_pages(client, None, 0, sleep=slept.append)  # type: ignore[arg-type]
    assert [g.request_id for g in got] == [f"g{i}" for i in range(5)]
    assert slept == [0.25, 0.25]
    assert [token for _, token in client.asked] == ["", "2", "4"]


@pytest.mark.parametrize("retry_after_ms", ["", "120000"])
def test_kvrelay_list_gives_up_on_a_refusal_without_a_wait_or_past_its_patience(retry_after_ms: str) -> None:
    client = _RateLimitedPages(5, refused=(2,), retry_after_ms=retry_after_ms)
    slept: list[float] = []
    with pytest.raises(KvRelayError, match="slow down"):
        _list_pages(client, None, 0, sleep=slept.append)  # type: ignore[arg-type]
    assert slept == []
