"""PagePool: all-or-nothing reservation, contiguity, exact accounting, illegal moves refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrelay.broker.pool import NeverFits, PagePool, PageState, PoolError, ReplicaPages


def test_reserves_every_row_in_one_contiguous_run_when_possible() -> None:
    pool = PagePool("dit-0", 16)
    assert pool.reserve([3, 2]) == [[0, 1, 2], [3, 4]]
    c = pool.counts()
    assert (c.free, c.reserved, c.draining) == (11, 5, 0)


def test_best_fit_keeps_large_runs_for_large_requests() -> None:
    pool = PagePool("dit-0", 20)
    a = pool.reserve([2])
    b = pool.reserve([10])
    c = pool.reserve([2])
    assert a and b and c
    pool.free(a[0])  # free run of 2 at 0..1, run of 6 at 14..19
    got = pool.reserve([2])
    assert got == [[0, 1]], "the 2-page hole fits exactly; the 6-page tail stays whole"


def test_rows_split_over_runs_only_when_no_single_run_fits() -> None:
    pool = PagePool("dit-0", 10)
    held = [pool.reserve([1]) for _ in range(10)]
    for h in held[1:4] + held[6:9]:  # free runs 1..3 and 6..8
        assert h is not None
        pool.free(h[0])
    rows = pool.reserve([3, 3])
    assert rows is not None
    assert sorted(rows) == [[1, 2, 3], [6, 7, 8]], "each row still gets a run of its own"


def test_all_or_nothing() -> None:
    pool = PagePool("dit-0", 8)
    assert pool.reserve([6]) is not None
    before = pool.counts()
    assert pool.reserve([1, 2]) is None, "3 pages do not fit in 2: no row may be half-reserved"
    assert pool.counts() == before


def test_never_fits_is_distinct_from_not_now() -> None:
    pool = PagePool("dit-0", 8)
    with pytest.raises(NeverFits):
        pool.reserve([5, 4])
    assert pool.counts().free == 8


def test_illegal_moves_are_refused_and_change_nothing() -> None:
    pool = PagePool("dit-0", 4)
    rows = pool.reserve([2])
    assert rows is not None
    with pytest.raises(PoolError, match="already free"):
        pool.free([3])
    with pytest.raises(PoolError, match="outside"):
        pool.mark_draining([7])
    with pytest.raises(PoolError, match="needs page 3 RESERVED"):
        pool.mark_draining([3])
    pool.mark_draining(rows[0])
    with pytest.raises(PoolError):
        pool.claim(rows[0], PageState.RESERVED)
    pool.free(rows[0])
    assert pool.counts().free == 4
    with pytest.raises(PoolError, match="double release"):
        pool.free(rows[0])


def test_claim_restores_exact_pages() -> None:
    pool = PagePool("dit-0", 6)
    pool.claim([4, 5], PageState.DRAINING)
    pool.claim([0], PageState.RESERVED)
    assert [pool.state_of(p) for p in range(6)] == [
        PageState.RESERVED, PageState.FREE, PageState.FREE, PageState.FREE, PageState.DRAINING, PageState.DRAINING
    ]
    assert pool.reserve([3]) == [[1, 2, 3]]


@given(st.lists(st.tuples(st.sampled_from(["reserve", "drain", "free"]), st.lists(st.integers(0, 6), max_size=2)),
                max_size=40))
def test_random_sequences_keep_pages_disjoint_and_counted(ops: list[tuple[str, list[int]]]) -> None:
    pool = PagePool("dit-0", 24)
    held: list[list[int]] = []
    draining: list[list[int]] = []
    for op, sizes in ops:
        if op == "reserve" and sizes:
            rows = pool.reserve(sizes)
            if rows is not None:
                assert [len(r) for r in rows] == sizes
                held.append([p for r in rows for p in r])
        elif op == "drain" and held:
            pages = held.pop(0)
            pool.mark_draining(pages)
            draining.append(pages)
        elif op == "free" and (held or draining):
            pool.free((draining or held).pop(0))
        owned = [p for group in held + draining for p in group]
        assert len(owned) == len(set(owned)), "a page is in two reservations"
        c = pool.counts()
        assert c.free + c.reserved + c.draining == c.total
        assert c.reserved == sum(len(g) for g in held)
        assert c.draining == sum(len(g) for g in draining)


def test_cfg_parallel_pages_reserve_each_row_only_in_its_groups_pool() -> None:
    """A CFG-parallel replica: row r lives in group r % 2's pool only, so both rows may carry the
    same page ids (pages of different ranks); fits and never-fits are per group; all or nothing."""
    pages = ReplicaPages("dit-0", 4, num_groups=2)
    assert pages.reserve([3, 2]) == [[0, 1, 2], [0, 1]]  # same ids, different groups' pages
    c = pages.counts()
    assert (c.total, c.free, c.reserved) == (8, 3, 5)
    assert pages.groups[0].counts().free == 1 and pages.groups[1].counts().free == 2
    # Group 0 has 1 free page: a request whose row 0 needs 2 waits, though 3 pages are free in all.
    assert not pages.fits_now([2, 1]) and pages.reserve([2, 1]) is None
    assert pages.counts().free == 3, "nothing reserved by a request that did not fit"
    assert pages.fits_now([1, 2]) and not pages.never_fits([4, 4]) and pages.never_fits([5])
    with pytest.raises(NeverFits, match="cfg1"):
        pages.reserve([1, 5])  # 6 pages <= 8 in total, but row 1 alone exceeds group 1's 4
    # A one-row request reserves nothing in group 1.
    assert pages.reserve([1]) == [[3]] and pages.groups[1].counts().free == 2
    pages.mark_draining([(0, [0, 1, 2]), (1, [0, 1])])
    assert pages.state_of(0, row=1) is PageState.DRAINING and pages.state_of(3, row=0) is PageState.RESERVED
    pages.free([(0, [0, 1, 2]), (1, [0, 1]), (0, [3])])
    assert pages.counts().free == 8
    with pytest.raises(PoolError, match="cfg1"):
        pages.free([(1, [0])])  # already free in group 1 (double release names the group's pool)
    # One group: exactly one PagePool (the replica id is the pool's name).
    plain = ReplicaPages("dit-1", 6)
    assert plain.reserve([3, 2]) == [[0, 1, 2], [3, 4]] and plain.groups[0].replica_id == "dit-1"
