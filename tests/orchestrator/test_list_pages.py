"""ListGenerations by pages: a call costs O(page_size) of the broker's loop whatever it holds, and
next_page_token reaches every generation once. Found black-box: a flood of ListGenerations (a
caller within its rate limit) took the broker's loop, a health check took 4.9 s; each call sorted
and snapshotted every generation held, and a public caller's copied every retained prompt."""

from __future__ import annotations

import grpc
import pytest

from kvrelay.broker.generations import (
    ErrorInfo,
    GenerationParams,
    GenerationRecord,
    GenerationStore,
    GenState,
)
from kvrelay.v1 import generation_pb2

from .harness import cluster, error_info, run

S = generation_pb2
PARAMS = GenerationParams("a cat", "", 1, 64, 64, 1, 1.0)
ENDINGS = (GenState.SUCCEEDED, GenState.FAILED, GenState.CANCELLED)


def _fill(store: GenerationStore, n: int, prefix: str = "g") -> list[str]:
    """`n` generations, oldest first: finished in turn SUCCEEDED/FAILED/CANCELLED, every 7th live."""
    ids = []
    for i in range(n):
        record, _ = store.create_or_attach(f"{prefix}{i}", PARAMS, True)
        if i % 7:
            state = ENDINGS[i % 3]
            error = None if state is GenState.SUCCEEDED else ErrorInfo("ABORTED", "X", "x")
            store.update(record, state, error=error)
        ids.append(record.request_id)
    return ids


def _walk(store: GenerationStore, states: tuple[GenState, ...], page_size: int, max_scan: int) -> list[str]:
    seen: list[str] = []
    after = None
    for _ in range(1000):
        page = store.list_page(states, page_size, after, max_scan)
        assert len(page.records) <= page_size
        seen += [r.request_id for r in page.records]
        if page.next_after is None:
            return seen
        after = page.next_after
    raise AssertionError("the pages never ended")


@pytest.mark.parametrize(("page_size", "max_scan"), [(1, 1), (3, 5), (10, 40), (1000, 4000)])
@pytest.mark.parametrize("states", [(), (GenState.FAILED,), (GenState.QUEUED, GenState.CANCELLED)])
def test_pages_reach_every_generation_once_newest_first(
    states: tuple[GenState, ...], page_size: int, max_scan: int
) -> None:
    clock = [0.0]
    store = GenerationStore(result_ttl_seconds=1e9, max_results=1000, clock=lambda: clock[0])
    ids = _fill(store, 60)
    # Ties of created_mono (a coarse clock) keep their creation order.
    ids += _fill(store, 10, prefix="tie")
    expected = [s.request_id for s in store.list_generations(states)]
    assert expected == [i for i in reversed(ids) if not states or store.get(i).state in states]
    assert _walk(store, states, page_size, max_scan) == expected


def test_a_page_stays_in_place_when_generations_come_and_go() -> None:
    """The cursor is a place in creation order, not an index: generations created or forgotten
    between two pages neither repeat nor skip the older ones."""
    clock = [0.0]

    def tick() -> float:
        clock[0] += 1.0
        return clock[0]

    store = GenerationStore(result_ttl_seconds=1e9, max_results=20, clock=tick)
    ids = _fill(store, 20)
    first = store.list_page((), 5, None, 5)
    assert [r.request_id for r in first.records] == ids[::-1][:5]
    _fill(store, 3, prefix="new")  # three newer; max_results evicts the three oldest finished
    rest = _walk_from(store, first.next_after)
    held = {s.request_id for s in store.list_generations()}
    assert rest == [i for i in ids[::-1][5:] if i in held]


def _walk_from(store: GenerationStore, after: tuple[float, int] | None) -> list[str]:
    seen: list[str] = []
    while after is not None:
        page = store.list_page((), 4, after, 4)
        seen += [r.request_id for r in page.records]
        after = page.next_after
    return seen


def test_a_filtered_page_looks_at_no_more_than_max_scan() -> None:
    """Thousands held and none matching: one page looks at max_scan of them and says where to go
    on, instead of walking them all in one call."""
    store = GenerationStore(result_ttl_seconds=1e9, max_results=10_000)
    for i in range(5000):
        record, _ = store.create_or_attach(f"s{i}", PARAMS, True)
        store.update(record, GenState.SUCCEEDED)
    looked: list[str] = []
    held = store._held

    def counting(request_id: str) -> GenerationRecord:
        looked.append(request_id)
        return held(request_id)

    store._held = counting  # type: ignore[method-assign]
    page = store.list_page((GenState.FAILED,), 100, None, 400)
    assert page.records == [] and page.next_after is not None
    assert len(looked) == 400


def test_list_generations_reads_only_its_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of 10 out of 3000 held snapshots (at most) those 10, and a finished generation's
    view is built once: before, every call snapshotted all 3000 (and sorted them)."""
    from kvrelay.security import Caller, CallerClass, _current_caller

    snapshots = [0]
    snapshot = GenerationRecord.snapshot

    def counted(self: GenerationRecord) -> object:
        snapshots[0] += 1
        return snapshot(self)

    async def body() -> None:
        async with cluster(max_results=5000) as c:
            _fill(c.orchestrator.store, 3000)
            monkeypatch.setattr(GenerationRecord, "snapshot", counted)
            token = _current_caller.set(Caller(frozenset({CallerClass.PUBLIC}), authenticated=True))
            try:
                for _ in range(2):
                    assert c.generation is not None
                    request = S.ListGenerationsRequest(page_size=10)
                    reply = await c.generation.ListGenerations(request, None)  # type: ignore[arg-type]
                    assert len(reply.generations) == 10 and reply.next_page_token
            finally:
                _current_caller.reset(token)
            # The newest 10 include one live generation (every 7th), rebuilt each call.
            assert snapshots[0] <= 12, snapshots[0]

    run(body())


def test_next_page_token_walks_the_listing_over_grpc() -> None:
    async def body() -> None:
        async with cluster() as c:
            ids = _fill(c.orchestrator.store, 23)
            seen: list[str] = []
            token = ""
            for _ in range(10):
                reply = await c.api.ListGenerations(
                    S.ListGenerationsRequest(page_size=5, page_token=token), timeout=5
                )
                seen += [g.request_id for g in reply.generations]
                token = reply.next_page_token
                if not token:
                    break
            assert seen == ids[::-1]
            failed = S.GENERATION_STATE_FAILED
            first = await c.api.ListGenerations(
                S.ListGenerationsRequest(states=[failed], page_size=2), timeout=5
            )
            again = await c.api.ListGenerations(
                S.ListGenerationsRequest(states=[failed], page_size=50, page_token=first.next_page_token),
                timeout=5,
            )
            listed = [g.request_id for g in [*first.generations, *again.generations]]
            assert listed == [i for i in ids[::-1] if c.orchestrator.store.get(i).state is GenState.FAILED]
            assert again.next_page_token == ""

    run(body())


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"page_token": "not-a-token"}, "page_token", "not a page token"),
        ({"page_token": "x" * 300}, "page_token", "at most 256"),
        ({"page_token": "other-states"}, "page_token", "other states"),
        ({"page_token": "other-broker"}, "page_token", "another broker process"),
        ({"states": [S.GENERATION_STATE_FAILED] * 8}, "states", "at most 7"),
    ],
)
def test_a_bad_page_token_or_states_is_invalid_argument(
    fields: dict[str, object], field: str, says: str
) -> None:
    from kvrelay.broker.generation import PageTokens

    async def body() -> None:
        async with cluster() as c:
            _fill(c.orchestrator.store, 4)
            first = await c.api.ListGenerations(S.ListGenerationsRequest(page_size=1), timeout=5)
            if fields.get("page_token") == "other-states":
                fields.update(page_token=first.next_page_token, states=[S.GENERATION_STATE_FAILED])
            elif fields.get("page_token") == "other-broker":
                fields["page_token"] = PageTokens(epoch="restarted").encode((0.0, 1), [])
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await c.api.ListGenerations(S.ListGenerationsRequest(**fields), timeout=5)  # type: ignore[arg-type]
            code, reason, metadata = error_info(exc.value)
            assert (code, reason, metadata["field"]) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_ARGUMENT",
                field,
            )
            assert says in (exc.value.details() or "")

    run(body())


def test_a_generation_discarded_then_ended_is_listed_and_expires_cleanly() -> None:
    """Admission discards a rejected generation and may end it after (its streams see the error):
    the store holds it again, so it is listed, and forgetting it later finds it in the order."""
    clock = [0.0]
    store = GenerationStore(result_ttl_seconds=10.0, max_results=10, clock=lambda: clock[0])
    record, _ = store.create_or_attach("rejected", PARAMS, True)
    store.discard(record)
    assert store.list_page((), 10, None, 10).records == []
    store.update(record, GenState.FAILED, error=ErrorInfo("UNAVAILABLE", "AR_UNAVAILABLE", "x"))
    assert [r.request_id for r in store.list_page((), 10, None, 10).records] == ["rejected"]
    clock[0] = 11.0
    assert store.list_page((), 10, None, 10).records == [] and store._order == []


def test_a_full_view_with_large_prompts_is_not_kept() -> None:
    """Views of finished generations are kept for the next listing, but a full one holds a copy
    of the prompts (up to 2 MiB): kept only when small, so retained prompts are never held twice."""
    from kvrelay.broker.generation import MAX_CACHED_VIEW_BYTES
    from kvrelay.security import Caller, CallerClass, _current_caller

    async def body() -> None:
        async with cluster() as c:
            assert c.generation is not None
            store = c.orchestrator.store
            for rid, prompt in (("small", "a cat"), ("large", "x" * MAX_CACHED_VIEW_BYTES)):
                record, _ = store.create_or_attach(rid, GenerationParams(prompt, "", 1, 64, 64, 1, 1.0), True)
                store.update(record, GenState.SUCCEEDED)
            for caller in (CallerClass.OPERATOR, CallerClass.PUBLIC):
                token = _current_caller.set(Caller(frozenset({caller}), authenticated=True))
                try:
                    reply = await c.generation.ListGenerations(S.ListGenerationsRequest(), None)  # type: ignore[arg-type]
                finally:
                    _current_caller.reset(token)
                assert len(reply.generations) == 2
            assert set(store.get("small").list_views) == {"full", "redacted"}
            assert set(store.get("large").list_views) == {"redacted"}

    run(body())
