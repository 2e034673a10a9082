"""The page fence's one rule, in-process: a page goes only to tickets of a higher sequence."""

from __future__ import annotations

import pytest

from kvrelay.dit_service.fence import PageFence, PageKey, Superseded, page_keys


def keys(*pages: int) -> list[PageKey]:
    return page_keys(0, pages)


def test_a_later_ticket_takes_the_pages_and_the_earlier_one_is_shut_out() -> None:
    fence = PageFence()
    fence.claim("a", 1, keys(0, 1))
    fence.check("a", keys(0, 1))
    fence.claim("b", 2, keys(1, 2))
    fence.check("a", keys(0))
    with pytest.raises(Superseded, match="page 1 now belongs to ticket b"):
        fence.check("a", keys(1))
    with pytest.raises(Superseded, match="no ticket"):
        fence.check("b", keys(3))


def test_a_stale_claim_never_supersedes_a_later_tickets() -> None:
    """Whatever the order the claims arrive in (a load of a released ticket whose watch lags),
    the later ticket keeps its pages, and a refused claim takes none of them."""
    fence = PageFence()
    fence.claim("b", 7, keys(4, 5))
    with pytest.raises(Superseded) as info:
        fence.claim("a", 3, keys(3, 4))
    assert (info.value.page, info.value.owner and info.value.owner.ticket_id) == ((0, 4), "b")
    assert fence.owner((0, 3)) is None, "all or nothing"
    fence.check("b", keys(4, 5))
    fence.claim("b", 7, keys(4, 5))  # its own again: fine
    fence.claim("c", 9, keys(5))
    with pytest.raises(Superseded):
        fence.check("b", keys(5))


def test_a_loaded_tickets_pages_take_no_chunk_until_a_later_ticket_claims_them() -> None:
    fence = PageFence()
    fence.claim("a", 1, keys(0, 1))
    fence.seal("a", 1, keys(0, 1))
    with pytest.raises(Superseded, match="verified for it"):
        fence.check("a", keys(0))
    with pytest.raises(Superseded):
        fence.claim("a", 1, keys(1))  # a new stream of the loaded ticket: refused too
    fence.claim("b", 2, keys(1))
    fence.check("b", keys(1))
    fence.seal("a", 1, keys(1))  # a late seal never takes a page back from a later ticket
    fence.check("b", keys(1))


def test_page_ids_are_per_cfg_group() -> None:
    """A CFG-parallel replica has one page-id space per group: page 2 of group 0 and page 2 of
    group 1 are two pages, which two live tickets may hold at once (keyed by the id alone, the
    later ticket's claim shut the earlier one out of its own page: its load failed TICKET_ENDED)."""
    fence = PageFence()
    fence.claim("late", 9, page_keys(1, [2, 3]))
    fence.claim("early", 5, page_keys(0, [1, 2]))  # the same ids, the other group: no conflict
    fence.check("early", page_keys(0, [1, 2]))
    fence.check("late", page_keys(1, [2, 3]))
    with pytest.raises(Superseded, match="page 2 of CFG group 1 now belongs to ticket late"):
        fence.claim("early", 5, page_keys(1, [2]))
    fence.seal("early", 5, page_keys(0, [1, 2]))
    fence.check("late", page_keys(1, [2]))
