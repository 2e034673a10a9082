"""Per-ticket staging regions over one registered staging buffer (DESIGN.md section 6).

Owns which bytes of an AR rank's staging buffer belong to which ticket. A ticket packs its KV
into its own region and its writes read from there; the region is handed back only after every
transport call reading it has returned. A write that went in doubt (the sender stopped waiting,
the engine still reads) therefore keeps its region, and the next ticket packs elsewhere instead
of overwriting bytes a late write may still carry to the DiT.

Pure bookkeeping: no memory, no threads, no clock. Every mutation checks the invariant it
protects and raises `StagingInUse` naming the culprit when a caller would break it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Regions start at multiples of this (cache lines; also keeps segment addresses aligned).
ALIGN = 64


class StagingInUse(AssertionError):
    """A region would be repacked, freed or overlapped while a transport call reads it."""


@dataclass(slots=True)
class StagingRegion:
    ticket_id: str
    offset: int
    length: int
    # Transport calls reading the region that have not returned yet.
    readers: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


class StagingAllocator:
    """First-fit allocation of aligned regions, one per ticket, over `capacity` bytes."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if capacity <= 0 or align <= 0:
            raise ValueError(f"capacity and align must be positive, got {capacity}, {align}")
        self.capacity = capacity
        self.align = align
        self._regions: dict[str, StagingRegion] = {}

    # -- queries -------------------------------------------------------------------------------

    def region(self, ticket_id: str) -> StagingRegion | None:
        return self._regions.get(ticket_id)

    def held(self) -> list[StagingRegion]:
        return sorted(self._regions.values(), key=lambda r: r.offset)

    def bytes_held(self) -> int:
        return sum(r.length for r in self._regions.values())

    # -- mutations -----------------------------------------------------------------------------

    def allocate(self, ticket_id: str, nbytes: int) -> StagingRegion | None:
        """A fresh region of at least `nbytes` for `ticket_id`; None when no gap is large enough
        now (space held by in-doubt writes comes back when their calls return)."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        old = self._regions.get(ticket_id)
        if old is not None:
            # A retried write of the same ticket repacks: only legal when nothing reads it.
            self._check_idle(old, "repacked")
            del self._regions[ticket_id]
        length = -(-nbytes // self.align) * self.align
        cursor = 0
        for r in self.held():
            if r.offset - cursor >= length:
                break
            cursor = r.end
        if cursor + length > self.capacity:
            return None
        region = StagingRegion(ticket_id, cursor, length)
        for r in self._regions.values():
            if region.offset < r.end and r.offset < region.end:
                raise StagingInUse(f"region of {ticket_id} would overlap the region of {r.ticket_id}: {r}")
        self._regions[ticket_id] = region
        return region

    def begin_read(self, ticket_id: str) -> None:
        """A transport call starts reading the ticket's region."""
        self._get(ticket_id).readers += 1

    def end_read(self, ticket_id: str) -> None:
        """That call returned (any status): nothing it started can read the region any more."""
        region = self._get(ticket_id)
        if region.readers <= 0:
            raise StagingInUse(f"end_read without begin_read for the region of {ticket_id}")
        region.readers -= 1

    def check_writable(self, ticket_id: str) -> StagingRegion:
        """Before packing into the region: no transport call may be reading it."""
        region = self._get(ticket_id)
        self._check_idle(region, "packed")
        return region

    def free(self, ticket_id: str) -> None:
        region = self._regions.get(ticket_id)
        if region is None:
            return
        self._check_idle(region, "freed")
        del self._regions[ticket_id]

    def _get(self, ticket_id: str) -> StagingRegion:
        region = self._regions.get(ticket_id)
        if region is None:
            raise KeyError(f"ticket {ticket_id} holds no staging region")
        return region

    @staticmethod
    def _check_idle(region: StagingRegion, what: str) -> None:
        if region.readers:
            raise StagingInUse(
                f"the staging region of ticket {region.ticket_id} would be {what} while {region.readers} "
                "transport call(s) still read it (an in-doubt write): its bytes may still be on their way"
            )


__all__ = ["ALIGN", "StagingAllocator", "StagingInUse", "StagingRegion"]
