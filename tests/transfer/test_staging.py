"""The per-ticket staging allocator: regions never overlap, and a region read by a running
transport call (an in-doubt write) is never repacked, freed or handed to another ticket."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvrelay.transfer.staging import ALIGN, StagingAllocator, StagingInUse


def test_a_region_being_read_cannot_be_freed_repacked_or_reused() -> None:
    alloc = StagingAllocator(4 * ALIGN)
    a = alloc.allocate("a", ALIGN + 1)
    assert a is not None and (a.offset, a.length) == (0, 2 * ALIGN)
    alloc.begin_read("a")
    with pytest.raises(StagingInUse, match="ticket a would be freed"):
        alloc.free("a")
    with pytest.raises(StagingInUse, match="repacked"):
        alloc.allocate("a", 8)
    with pytest.raises(StagingInUse, match="packed"):
        alloc.check_writable("a")
    # The next ticket packs into the space that is left, without waiting for a's call.
    b = alloc.allocate("b", 2 * ALIGN)
    assert b is not None and b.offset == 2 * ALIGN
    assert alloc.allocate("c", 1) is None, "full: only space not read by a call is handed out"
    alloc.end_read("a")
    alloc.free("a")
    c = alloc.allocate("c", 1)
    assert c is not None and c.offset == 0
    with pytest.raises(StagingInUse):
        alloc.end_read("c")


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = StagingAllocator(16 * ALIGN)
        self.reading: dict[str, int] = {}
        self.n = 0

    @rule(size=st.integers(1, 6 * ALIGN))
    def allocate(self, size: int) -> None:
        self.n += 1
        tid = f"t{self.n}"
        region = self.alloc.allocate(tid, size)
        if region is None:
            free = 16 * ALIGN - self.alloc.bytes_held()
            assert free < size or any(True for _ in self.alloc.held()), "refused although empty"
        else:
            assert region.length >= size and region.offset % ALIGN == 0
            self.reading[tid] = 0

    @rule(data=st.data())
    def start_call(self, data: st.DataObject) -> None:
        if self.reading:
            tid = data.draw(st.sampled_from(sorted(self.reading)))
            self.alloc.begin_read(tid)
            self.reading[tid] += 1

    @rule(data=st.data())
    def call_returns(self, data: st.DataObject) -> None:
        busy = sorted(t for t, n in self.reading.items() if n)
        if busy:
            tid = data.draw(st.sampled_from(busy))
            self.alloc.end_read(tid)
            self.reading[tid] -= 1

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if self.reading:
            tid = data.draw(st.sampled_from(sorted(self.reading)))
            if self.reading[tid]:
                with pytest.raises(StagingInUse):
                    self.alloc.free(tid)
            else:
                self.alloc.free(tid)
                del self.reading[tid]

    @invariant()
    def regions_are_disjoint_and_inside(self) -> None:
        held = self.alloc.held()
        assert {r.ticket_id for r in held} == set(self.reading)
        for a, b in zip(held, held[1:], strict=False):
            assert a.end <= b.offset
        assert all(0 <= r.offset and r.end <= 16 * ALIGN for r in held)
        assert all(r.readers == self.reading[r.ticket_id] for r in held)


TestAllocator = AllocatorMachine.TestCase
