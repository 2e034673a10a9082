"""The page fence of one DiT replica: which ticket each page belongs to here, as far as any write
into it is concerned.

Owns one rule (docs/dit_service.md, "The page fence"): a page goes only forward, to tickets of a
higher reservation sequence. The broker reserves a page for a ticket only after the page's
previous ticket was released, and numbers tickets in the order it creates them, so the ticket
holding a page now always has the highest sequence of every ticket that ever held it. A claim
(a gRPC write's first chunk, a load before it verifies) therefore takes a page from a ticket of
a lower sequence, and is refused by one of a higher: that one proves the claimant ended. Claims
are never released: a page stays fenced against every earlier ticket until a later one claims it.
Once a ticket is loaded its pages are sealed: no chunk lands in pages the ranks read, not even
one of that ticket (every write of a loaded ticket is final: only a replay or a hostile caller
sends one then).

Before, the claim order decided: a stale claim (a load of a ticket released under it, whose
watch lagged) superseded the live next ticket's, and that ticket's chunks were refused.
A page is named by (CFG group, page id): a CFG-parallel replica (`cfg_parallel_size` 2) has one
page-id space per group (the broker keeps a pool per group), so page 2 of group 0 and page 2 of
group 1 are different pages that two live tickets may hold at once. Keyed by the id alone, the
later ticket's claim of one shut the earlier ticket out of the other: its load failed
TICKET_ENDED "page 2 now belongs to ticket ..." while both were live (found by the bench's
CFG=2 layout in CI).

Pure: no gRPC, no clock; the servicer maps `Superseded` to TICKET_NOT_WRITABLE / TICKET_ENDED.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PageId = int
TicketId = str
# (CFG group, page id): a page of the replica. Group 0 is every page of a replica without CFG-parallel.
PageKey = tuple[int, int]


def page_keys(group: int, pages: Iterable[PageId]) -> list[PageKey]:
    """The keys of `pages` of one CFG group."""
    return [(int(group), int(p)) for p in pages]


def _name(page: PageKey) -> str:
    group, page_id = page
    return f"page {page_id}" if group == 0 else f"page {page_id} of CFG group {group}"


@dataclass(frozen=True, slots=True)
class Claim:
    ticket_id: TicketId
    sequence: int
    # Every load of the ticket is verified: no write of it may land any more (its own included:
    # by READY every write is final, so a chunk now is a replay or a hostile caller's).
    sealed: bool = False


class Superseded(Exception):
    """A page of the ticket belongs to another one: to a later ticket (`claim` refused), or to no
    ticket of its own any more (`check`). Nothing of the named ticket may land in it."""

    def __init__(self, ticket_id: TicketId, page: PageKey, owner: Claim | None) -> None:
        self.ticket_id, self.page, self.owner = ticket_id, page, owner
        if owner is not None and owner.ticket_id == ticket_id and owner.sealed:
            why = f"{_name(page)} is verified for it (the ticket is loaded)"
        else:
            held = "no ticket" if owner is None else f"ticket {owner.ticket_id} (sequence {owner.sequence})"
            why = f"{_name(page)} now belongs to {held}"
        super().__init__(f"ticket {ticket_id}: {why}: no write of it may land")


class PageFence:
    """(CFG group, page) -> the claim that holds it. `claim` and `check` are all or nothing."""

    def __init__(self) -> None:
        self._owner: dict[PageKey, Claim] = {}
        # The highest sequence ever claimed (0: none): told to the broker at registration, so that
        # one on a journal older than a ticket this DiT saw fences it (docs/broker.md).
        self.highest_sequence = 0

    def owner(self, page: PageKey) -> Claim | None:
        return self._owner.get(page)

    def claim(self, ticket_id: TicketId, sequence: int, pages: Iterable[PageKey]) -> None:
        """Take `pages` for the ticket; raises Superseded (and takes none) when a ticket of a
        higher sequence holds one of them: the claimant's own ticket has ended."""
        pages = [(int(g), int(p)) for g, p in pages]
        claim = Claim(ticket_id, int(sequence))
        for page in pages:
            owner = self._owner.get(page)
            if owner is not None and owner.ticket_id != ticket_id and owner.sequence > claim.sequence:
                raise Superseded(ticket_id, page, owner)
            if owner is not None and owner.ticket_id == ticket_id and owner.sealed:
                raise Superseded(ticket_id, page, owner)
        for page in pages:
            self._owner[page] = claim
        self.highest_sequence = max(self.highest_sequence, claim.sequence)

    def seal(self, ticket_id: TicketId, sequence: int, pages: Iterable[PageKey]) -> None:
        """The ticket is loaded (every write final and verified): its pages take no chunk any
        more, its own included, until a later ticket claims them."""
        sealed = Claim(ticket_id, int(sequence), sealed=True)
        for group, page in pages:
            key = (int(group), int(page))
            owner = self._owner.get(key)
            if owner is None or owner.ticket_id == ticket_id:
                self._owner[key] = sealed

    def check(self, ticket_id: TicketId, pages: Iterable[PageKey]) -> None:
        """Raises Superseded unless every page is held by `ticket_id`, unsealed (a chunk may land)."""
        for group, page in pages:
            key = (int(group), int(page))
            owner = self._owner.get(key)
            if owner is None or owner.ticket_id != ticket_id or owner.sealed:
                raise Superseded(ticket_id, key, owner)


__all__ = ["Claim", "PageFence", "PageKey", "Superseded", "page_keys"]
