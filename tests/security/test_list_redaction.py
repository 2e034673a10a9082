"""A public caller's ListGenerations names no internal id in any field, free text included: found
black-box, the redacted listing blanked request_id, ticket_id and prompts but showed error
messages whole, which name tickets, replicas, their hosts and paths. The owner (GetGeneration
with the request_id) and an operator still see everything."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from kvrelay.broker.generations import ErrorInfo, GenerationParams, GenState
from kvrelay.security import Caller, CallerClass, _current_caller
from kvrelay.v1 import generation_pb2
from tests.orchestrator.harness import Cluster, cluster, collect, request, run, wait_until

S = generation_pb2
PUBLIC = Caller(frozenset({CallerClass.PUBLIC}), authenticated=True)
OPERATOR = Caller(frozenset({CallerClass.OPERATOR}), authenticated=True)
PROMPT = "a fox at 10.9.8.7 in /srv/secret"
# Failures as the broker words them (pipeline.stage_error, orchestrator retries and cancels).
INJECTED = {
    "timeout": ("t-00000000000000aa", ErrorInfo(
        "UNAVAILABLE", "TRANSFER_TIMEOUT",
        "Denoise on DIT replica dit-0: ticket t-00000000000000aa: rows not loaded within 5 s from ar-0 at "
        "10.1.2.3:15001 (tried 2 times; earlier transfers failed: ar-0 -> dit-0 TRANSFER_TIMEOUT)",
    )),
    "dit-failed": ("t-00000000000000bb", ErrorInfo(
        "INTERNAL", "REPLICA_FAILED",
        "Denoise on DIT replica dit-1 (dit-1.pod.cluster.local:50061): rank 1 died, see "
        "/var/log/kvrelay/dit-1/rank1.log",
    )),
    "ticket-cancelled": ("t-00000000000000cc", ErrorInfo(
        "CANCELLED", "TICKET_CANCELLED", "ticket t-00000000000000cc was cancelled by an operator on dit-0",
    )),
    "odd-reason": ("t-00000000000000dd", ErrorInfo(
        "NOT_A_CODE", "t-00000000000000dd lost", "ticket t-00000000000000dd lost on ar-0",
    )),
}  # fmt: skip
SECRETS = ("t-000", "ar-0", "dit-0", "dit-1", "10.1.2.3", "cluster.local", "/var/log", PROMPT, "fox")


async def _listing(c: Cluster, caller: Caller) -> generation_pb2.ListGenerationsResponse:
    assert c.generation is not None
    token = _current_caller.set(caller)
    try:
        return await c.generation.ListGenerations(S.ListGenerationsRequest(), None)  # type: ignore[arg-type]
    finally:
        _current_caller.reset(token)


async def _fail_some(c: Cluster) -> tuple[list[str], asyncio.Task[object]]:
    """Generations ended in each way: injected failures, a real cancel, a real success, and one
    live when the broker stops (failed by the stop, journaled, restored after the restart)."""
    store = c.orchestrator.store
    for rid, (ticket_id, error) in INJECTED.items():
        record, _ = store.create_or_attach(rid, GenerationParams(PROMPT, PROMPT, 1, 64, 64, 1, 2.0), True)
        store.update(record, GenState.DENOISING, ticket_id=ticket_id)
        state = GenState.CANCELLED if error.code == "CANCELLED" else GenState.FAILED
        store.update(record, state, error=error)
        store.persist(record)
    await collect(c.api.Generate(request(PROMPT, request_id="ok", seed=1), timeout=10))
    c.ar.prefill_gate.clear()
    cancelled = c.api.Generate(
        request(PROMPT, request_id="cancelled", seed=2, detach_timeout_seconds=60), timeout=10
    )
    await wait_until(lambda: "cancelled" in c.ar.prefills, what="prefilling")
    await c.api.CancelGeneration(S.CancelGenerationRequest(request_id="cancelled"), timeout=5)
    assert (await collect(cancelled))[-1].state == S.GENERATION_STATE_CANCELLED
    # The last one stays live (prefilling, its stream detached) until the broker stops.
    live = asyncio.get_running_loop().create_task(
        collect(
            c.api.Generate(
                request(PROMPT, request_id="restart", seed=3, detach_timeout_seconds=60), timeout=30
            )
        )
    )
    await wait_until(lambda: "restart" in c.ar.prefills, what="restart prefilling")
    return [*INJECTED, "ok", "cancelled", "restart"], live


def _assert_redacted(reply: generation_pb2.ListGenerationsResponse, ids: list[str]) -> None:
    wire = reply.SerializeToString()
    for secret in (*SECRETS, *ids):
        assert secret.encode() not in wire, f"{secret!r} in the public listing: {reply}"
    for g in reply.generations:
        assert (g.request_id, g.ticket_id, g.params.prompt, g.params.negative_prompt) == ("", "", "", "")
        assert g.error.message == ""
    reasons = {g.error.reason for g in reply.generations if g.HasField("error")}
    # The reason and code stay: what went wrong, without where.
    assert {"TRANSFER_TIMEOUT", "REPLICA_FAILED", "TICKET_CANCELLED", "UNKNOWN"} <= reasons, reasons
    assert {g.error.code for g in reply.generations if g.HasField("error")} <= {
        "UNAVAILABLE",
        "INTERNAL",
        "CANCELLED",
        "UNKNOWN",
        "ABORTED",
    }


def test_the_public_listing_names_no_internal_id_the_owner_still_sees_them(tmp_path: Path) -> None:
    journal = str(tmp_path / "broker.sqlite")

    async def body() -> None:
        async with cluster(journal_path=journal) as c:
            ids, live = await _fail_some(c)
            _assert_redacted(await _listing(c, PUBLIC), ids)
        with contextlib.suppress(Exception):  # its stream ended with the broker
            await live
        # A broker restart: the finished ones come back from the journal, the live one ended
        # BROKER_SHUTTING_DOWN.
        async with cluster(journal_path=journal) as c:
            public = await _listing(c, PUBLIC)
            assert len(public.generations) == len(ids)
            _assert_redacted(public, ids)
            restarted = c.orchestrator.store.get("restart")
            # Ended as the first broker stopped (its AR went first here): a real message naming ar-0.
            assert restarted.state is GenState.FAILED and restarted.error is not None
            assert "ar-0" in restarted.error.message
            # The owner (the request_id is the capability) and an operator see it all.
            for rid, (ticket_id, error) in INJECTED.items():
                got = (
                    await c.api.GetGeneration(S.GetGenerationRequest(request_id=rid), timeout=5)
                ).generation
                assert (got.ticket_id, got.error.message, got.error.reason) == (
                    ticket_id,
                    error.message,
                    error.reason,
                )
                assert got.params.prompt == PROMPT
            operator = {g.request_id: g for g in (await _listing(c, OPERATOR)).generations}
            assert set(operator) == set(ids)
            assert operator["timeout"].error.message == INJECTED["timeout"][1].message
            assert operator["timeout"].ticket_id == INJECTED["timeout"][0]

    run(body())
