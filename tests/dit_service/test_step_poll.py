"""The service's reads of a running denoise's step counter back off between steps (CPU on small
hosts) and come back to STEP_POLL_S as soon as a step is seen."""

from __future__ import annotations

from kvrelay.dit_service.service import STEP_POLL_MAX_S, STEP_POLL_S, next_step_poll


def polls_during(step_s: float) -> int:
    """How many reads one step of `step_s` seconds costs, starting right after the previous one."""
    waited, poll, reads = 0.0, STEP_POLL_S, 0
    while True:
        waited += poll
        reads += 1
        if waited >= step_s:
            return reads
        poll = next_step_poll(poll, advanced=False)


def test_backs_off_while_no_step_and_resets_on_one() -> None:
    poll = STEP_POLL_S
    seen = [poll]
    for _ in range(8):
        poll = next_step_poll(poll, advanced=False)
        seen.append(poll)
    assert seen[:4] == [0.01, 0.02, 0.04, 0.08]
    assert max(seen) == STEP_POLL_MAX_S == seen[-1]
    assert next_step_poll(STEP_POLL_MAX_S, advanced=True) == STEP_POLL_S


def test_a_cpu_step_costs_a_handful_of_reads_not_a_hundred() -> None:
    # A ~1 s step (small preset, 2 cores): 10 ms flat was 100 reads per step per request.
    assert polls_during(1.0) <= 10
    # A ~47 ms GPU step is still seen within ~25 ms of its end.
    assert polls_during(0.047) == 3
