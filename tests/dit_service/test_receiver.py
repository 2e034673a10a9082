"""The DiT's load protocol as a pure object: which loads to verify, when to wait, when to fail."""

from __future__ import annotations

from kvrelay.dit_service.receiver import Fail, Loaded, LoadProtocol, Verify, Wait, WriteReport
from kvrelay.v1 import broker_pb2, common_pb2

OK, IN_DOUBT = common_pb2.WRITE_STATUS_OK, common_pb2.WRITE_STATUS_IN_DOUBT
WRITING, READY = broker_pb2.TICKET_STATE_WRITING, broker_pb2.TICKET_STATE_READY
# 2 rows, 2 AR ranks -> 2 DiT ranks (one write per row and rank pair with the same heads).
PLANNED = [(r, s, s) for r in (0, 1) for s in (0, 1)]


def _protocol(budget_end: float = 10.0) -> LoadProtocol:
    return LoadProtocol("t", PLANNED, budget_end, recheck_first_s=0.01, recheck_max_s=0.04)


def test_loads_are_verified_as_their_writes_report_ok_then_loaded_once_ready() -> None:
    p = _protocol()
    p.on_ticket(WRITING, {}, [])
    assert p.next_command(0.0) == Wait(10.0)
    p.on_ticket(WRITING, {(0, 0, 0): WriteReport(OK, 1), (1, 1, 1): WriteReport(OK, 2)}, [])
    assert p.next_command(0.0) == Verify(((0, 0), (1, 1)))
    p.on_verified((0, 0), True)
    p.on_verified((1, 1), True)
    p.on_ticket(WRITING, {k: WriteReport(OK, 1) for k in PLANNED}, [(0, 0), (1, 1)])
    assert p.next_command(0.1) == Verify(((0, 1), (1, 0)))
    p.on_verified((0, 1), True)
    p.on_verified((1, 0), True)
    assert isinstance(p.next_command(0.2), Wait), "every load reported, the ticket not READY yet"
    p.on_ticket(READY, {k: WriteReport(OK, 1) for k in PLANNED}, [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert p.next_command(0.3) == Loaded()


def test_a_checksum_mismatch_is_rechecked_with_backoff_until_the_budget() -> None:
    p = _protocol(budget_end=1.0)
    p.on_ticket(WRITING, {k: WriteReport(OK, 1) for k in PLANNED}, [])
    ready = Verify(((0, 0), (0, 1), (1, 0), (1, 1)))
    assert p.next_command(0.0) == ready
    for load in ready.loads:
        p.on_verified(load, False)  # bytes still landing
    assert p.next_command(0.0) == Wait(0.01)
    assert p.next_command(0.01) == ready
    for load in ready.loads:
        p.on_verified(load, False)
    assert p.next_command(0.02) == Wait(0.02)
    assert p.next_command(0.04) == ready
    for load in ready.loads:
        p.on_verified(load, False)
    fail = p.next_command(1.0)
    assert isinstance(fail, Fail) and (fail.code, fail.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT")


def test_a_timeout_names_the_loads_whose_reported_bytes_never_matched() -> None:
    p = _protocol(budget_end=5.0)
    p.on_ticket(WRITING, {k: WriteReport(OK, 1) for k in PLANNED}, [])
    assert p.next_command(0.0) == Verify(((0, 0), (0, 1), (1, 0), (1, 1)))
    p.on_verified((0, 0), True, 0.5)
    p.on_verified((0, 1), True, 0.5)
    p.on_verified((1, 0), False, 0.5)
    p.on_verified((1, 1), False, 0.5)
    assert p.mismatching_since == {(1, 0): 0.5, (1, 1): 0.5}
    assert p.next_command(1.0) == Verify(((1, 0), (1, 1)))
    p.on_verified((1, 0), True, 1.0)  # landed late: no longer mismatching
    p.on_verified((1, 1), False, 1.0)  # the first mismatch's time is kept
    assert p.mismatching_since == {(1, 1): 0.5}
    assert p.next_command(5.0) == Verify(((1, 1),))
    p.on_verified((1, 1), False, 5.0)
    fail = p.next_command(5.0)
    assert isinstance(fail, Fail) and fail.reason == "TRANSFER_TIMEOUT"
    assert "rows/ranks [(1, 1)] were reported written but never matched their checksums (since 4.50s)" in fail.message
    # A load that timed out without a mismatch (never reported) is not called mismatching.
    q = _protocol(budget_end=1.0)
    q.on_ticket(WRITING, {}, [])
    other = q.next_command(1.0)
    assert isinstance(other, Fail) and "never matched" not in other.message


def test_an_in_doubt_write_fails_the_wait_as_a_timeout_and_a_failed_one_as_transfer_failed() -> None:
    p = _protocol()
    p.on_ticket(WRITING, {(0, 0, 0): WriteReport(OK, 1), (1, 0, 0): WriteReport(IN_DOUBT, 0)}, [])
    fail = p.next_command(0.0)
    assert isinstance(fail, Fail) and (fail.code, fail.reason) == ("DEADLINE_EXCEEDED", "TRANSFER_TIMEOUT")
    assert "in doubt" in fail.message
    p = _protocol()
    p.on_ticket(WRITING, {(0, 1, 1): WriteReport(common_pb2.WRITE_STATUS_NOT_STARTED, 0)}, [])
    fail = p.next_command(0.0)
    assert isinstance(fail, Fail) and (fail.code, fail.reason) == ("UNAVAILABLE", "TRANSFER_FAILED")


def test_a_ticket_that_ends_under_the_load_fails_it() -> None:
    p = _protocol()
    p.on_ticket(broker_pb2.TICKET_STATE_DRAINING, {}, [])
    fail = p.next_command(0.0)
    assert isinstance(fail, Fail) and fail.reason == "TICKET_ENDED"


def test_cfg_parallel_plan_expects_loads_only_on_each_rows_group() -> None:
    """CFG=2 x 1 shard: row 0 lands on rank 0, row 1 on rank 1; no load of a row on the other rank."""
    p = LoadProtocol("t", [(0, 0, 0), (1, 0, 1)], 10.0)
    assert p.pending == {(0, 0), (1, 1)}
    p.on_ticket(WRITING, {(0, 0, 0): WriteReport(OK, 1), (1, 0, 1): WriteReport(OK, 2)}, [])
    assert p.next_command(0.0) == Verify(((0, 0), (1, 1)))
    p.on_verified((0, 0), True)
    p.on_verified((1, 1), True)
    p.on_ticket(READY, {(0, 0, 0): WriteReport(OK, 1), (1, 0, 1): WriteReport(OK, 2)}, [(0, 0), (1, 1)])
    assert p.next_command(0.0) == Loaded()
