"""The page fence's one rule, in-process: a page goes only to tickets of a higher sequence."""

from __future__ import annotations

import pytest

from kvrelay.dit_service.fence import PageFence, Superseded


def test_a_later_ticket_takes_the_pages_and_the_earlier_one_is_shut_out() -> None:
    fence = PageFence()
    fence.claim("a", 1, [0, 1])
    fence.check("a", [0, 1])
    fence.claim("b", 2, [1, 2])
    fence.check("a", [0])
    with pytest.raises(Superseded, match="page 1 now belongs to ticket b"):
        fence.check("a", [1])
    with pytest.raises(Superseded, match="no ticket"):
        fence.check("b", [3])


def test_a_stale_claim_never_supersedes_a_later_tickets() -> None:
    """Whatever the order the claims arrive in (a load of a released ticket whose watch lags),
    the later ticket keeps its pages, and a refused claim takes none of them."""
    fence = PageFence()
    fence.claim("b", 7, [4, 5])
    with pytest.raises(Superseded) as info:
        fence.claim("a", 3, [3, 4])
    assert (info.value.page, info.value.owner and info.value.owner.ticket_id) == (4, "b")
    assert fence.owner(3) is None, "all or nothing"
    fence.check("b", [4, 5])
    fence.claim("b", 7, [4, 5])  # its own again: fine
    fence.claim("c", 9, [5])
    with pytest.raises(Superseded):
        fence.check("b", [5])


def test_a_loaded_tickets_pages_take_no_chunk_until_a_later_ticket_claims_them() -> None:
    fence = PageFence()
    fence.claim("a", 1, [0, 1])
    fence.seal("a", 1, [0, 1])
    with pytest.raises(Superseded, match="verified for it"):
        fence.check("a", [0])
    with pytest.raises(Superseded):
        fence.claim("a", 1, [1])  # a new stream of the loaded ticket: refused too
    fence.claim("b", 2, [1])
    fence.check("b", [1])
    fence.seal("a", 1, [1])  # a late seal never takes a page back from a later ticket
    fence.check("b", [1])
